"""The `elastune` command line: manifests, local runs, the operator, the data-plane processes, and the
simulators and benchmarks (found by entry point)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from . import dataplane, extensions, local, manifests, operator_cmd

DISTRIBUTION = "elastune"


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastune", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    manifests.register(sub)
    local.register(sub)
    operator_cmd.register(sub)
    dataplane.register(sub)
    extensions.register(sub)
    return parser


def _pass_through() -> dict[str, Callable[[list[str]], int]]:
    """Commands whose arguments go verbatim to another parser (argparse's REMAINDER drops leading flags)."""
    table: dict[str, Callable[[list[str]], int]] = {n: r for n, (_, r) in dataplane.COMMANDS.items()}
    for name in extensions.names():
        table[name] = functools.partial(extensions.run, name)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["operator"] and not {"-h", "--help"} & set(argv[1:]):
        return operator_cmd.run(argv[1:])  # kopf parses its own flags
    runner = _pass_through().get(argv[0]) if argv else None
    if runner is not None:
        return runner(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
