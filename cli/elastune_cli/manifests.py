"""`elastune crds` and `elastune validate`: the CRDs generated from the API models, and manifests checked
the way the API server (CRD schema) and the operator (models) will check them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _crds(args: argparse.Namespace) -> int:
    from elastune_contract.api.crds import render_crds, write_crds

    if args.write:
        for path in write_crds(Path(args.write)):
            print(f"wrote {path}")
        return 0
    print("\n---\n".join(text.rstrip("\n") for _, text in sorted(render_crds().items())))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from elastune_contract.api import manifests

    failed = 0
    for m in manifests.load([Path(f) for f in args.file]):
        if m.problems:
            failed += 1
            print(f"{m.file}: {m.name}: invalid", file=sys.stderr)
            for problem in m.problems:
                print(f"  {problem}", file=sys.stderr)
        else:
            print(f"{m.file}: {m.name}: valid")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    crds = sub.add_parser("crds", help="print the CRDs generated from the API models (or --write them)")
    crds.add_argument("--write", metavar="DIR", help="write one YAML file per CRD into DIR")
    crds.set_defaults(func=_crds)

    val = sub.add_parser("validate", help="validate manifests against the CRD schemas and the API models")
    val.add_argument("-f", "--file", action="append", required=True, help="manifest file (repeatable)")
    val.set_defaults(func=_validate)
