"""Commands that packages outside the product add to `elastune` through the ``elastune.commands`` entry
points (pyproject.toml): the benchmarks (`bench`) and the scheduling simulator (`simulate`, `calibrate`),
both in ``elastune_bench``. The CLI never imports them; it loads ``main(argv)`` by entry point and says
what to install when the package is missing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata
from importlib.metadata import EntryPoint

GROUP = "elastune.commands"

#: The commands the project's own benchmarks package provides, with their help (listed even when it is
#: not installed, so `elastune --help` reads the same everywhere).
KNOWN: dict[str, str] = {
    "simulate": "compare PromptTuner, INFless and ElasticFlow on a sample trace (elastune simulate --help)",
    "calibrate": "fit the calibrated workload profile to the paper's figures; print residuals",
    "bench": "benchmarks that print measured figures (the elastune_bench package: elastune bench --help)",
}
MISSING = (
    "the benchmarks package (elastune_bench, folder bench/ of the source tree) is not installed here: "
    "pip install -e '.[dev,worker,gateway]' from a checkout"
)


def entry_point(name: str) -> EntryPoint | None:
    found = metadata.entry_points(group=GROUP, name=name)
    return next(iter(found)) if found else None


def names() -> list[str]:
    """The known commands, then any other package's, in entry-point order."""
    extra = [ep.name for ep in metadata.entry_points(group=GROUP) if ep.name not in KNOWN]
    return [*KNOWN, *extra]


def run(name: str, argv: list[str]) -> int:
    """`elastune NAME ...`: call the entry point's ``main`` with the arguments after NAME."""
    ep = entry_point(name)
    command: Callable[[list[str]], int] | None = None
    try:
        command = ep.load() if ep is not None else None
    except ImportError as exc:
        print(f"elastune {name}: {exc}", file=sys.stderr)
    if command is None:
        print(f"elastune {name}: {MISSING}", file=sys.stderr)
        return 2
    return int(command(argv) or 0)


def register(sub: argparse._SubParsersAction) -> None:
    for name in names():
        p = sub.add_parser(name, help=KNOWN.get(name, f"provided by {_module(name)}"), add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=lambda args, name=name: run(name, args.rest))


def _module(name: str) -> str:
    ep = entry_point(name)
    return ep.module if ep is not None else "an installed package"
