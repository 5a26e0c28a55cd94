"""The prepared GPU check (issue 26 item 4): ``tools/device_check.sh [--smoke] OUTDIR`` runs ``run.py``,
which runs each part (one module here each) in its own interpreter under its own time box: a part
that crashes, hangs or runs out of memory costs only its own figures. Each part writes
``OUTDIR/<part>.json`` as soon as it finishes; ``table.py`` writes ``OUTDIR/table.md`` last."""
