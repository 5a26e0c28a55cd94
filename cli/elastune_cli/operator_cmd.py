"""`elastune operator [kopf run flags]`: the Kubernetes operator, i.e. kopf's own runner over the
operator's handlers (``kopf run -m elastune_operator.k8s.handlers``) in this process.

The flags go to ``kopf run`` untouched (kopf parses them); the parser here exists for ``--help`` and the
CLI reference, and tests/cli checks each flag it lists against ``kopf run --help``.
"""

from __future__ import annotations

import argparse
import os
import sys

HANDLERS = "elastune_operator.k8s.handlers"
HELP = "run the Kubernetes operator (kopf run over elastune_operator.k8s.handlers)"
DESCRIPTION = (
    f"Run the Elastune operator: `kopf run -m {HANDLERS}` with the flags given here. It watches TuningJobs, "
    "LoRAAdapters and WarmPools through the API server it finds in the kubeconfig or the pod's service "
    "account, schedules TuningJobs onto the pools' workers every round, and keeps their status. The "
    "operator image and the Helm chart run it as `elastune operator`."
)

#: kopf run's flags as (names, metavar or None for a switch, help); the ones the chart and docs use.
KOPF_RUN_FLAGS: tuple[tuple[tuple[str, ...], str | None, str], ...] = (
    (("-A", "--all-namespaces"), None, "watch every namespace (the chart's default)"),
    (("-n", "--namespace"), "NS", "watch this namespace (repeatable; a glob pattern is allowed)"),
    (("--standalone",), None, "no peering: run without looking for other operators of the same peering"),
    (("--dev",), None, "development mode: higher priority, a peering of its own"),
    (("-L", "--liveness"), "URL", "serve a liveness probe here (e.g. http://0.0.0.0:8080/healthz)"),
    (("-P", "--peering"), "NAME", "the peering object that keeps one operator active (env KOPF_RUN_PEERING)"),
    (("-p", "--priority"), "N", "this operator's priority within its peering"),
    (("-v", "--verbose"), None, "log more"),
    (("-d", "--debug"), None, "log kopf's debug messages"),
    (("-q", "--quiet"), None, "log warnings and errors only"),
    (("--log-format",), "FORMAT", "plain, full or json"),
)


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Fill the `operator` subparser: help and the kopf run flags it passes on (documentation only)."""
    for names, metavar, help_text in KOPF_RUN_FLAGS:
        if metavar is None:
            parser.add_argument(*names, action="store_true", help=help_text)
        else:
            parser.add_argument(*names, metavar=metavar, help=help_text)
    return parser


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "operator",
        help=HELP,
        description=DESCRIPTION,
        epilog="Every other `kopf run` flag passes through as well (python -m kopf run --help).",
    )
    build_parser(p)
    p.set_defaults(func=lambda args: run([]))


def run(argv: list[str]) -> int:
    """Replace this process with kopf's runner (signals and exit codes are then kopf's)."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "kopf", "run", "-m", HANDLERS, *argv])
    return 0  # not reached
