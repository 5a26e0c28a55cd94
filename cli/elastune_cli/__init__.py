"""The `elastune` command line: one module per group of subcommands (``main.py`` assembles them).

It may import the product packages and the demo fixtures, never the benchmarks or the test support:
commands that live there (`elastune bench`, `elastune simulate`, `elastune calibrate`) are found through
the ``elastune.commands`` entry points (``extensions.py``)."""
