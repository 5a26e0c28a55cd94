"""``python -m elastune_bench BENCHMARK [flags]``: the same as ``elastune bench BENCHMARK [flags]``."""

from elastune_bench.cli import main

raise SystemExit(main())
