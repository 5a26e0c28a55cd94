"""`python -m elastune_worker serve ...`: the worker process (what `elastune worker` runs)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("serve",):
        print(
            "usage: python -m elastune_worker serve --pool POOL --model MODEL --redis-url URL [...]",
            file=sys.stderr,
        )
        return 2
    from elastune_worker.server.app import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
