"""``python -m elastune_cli``: the same as ``elastune``."""

from elastune_cli.main import main

raise SystemExit(main())
