"""Test support, never imported by product code: a Kubernetes API emulator the real kopf operator
can talk HTTP to (``emulator``, ``fixtures``), the workload stand-in (``workload_standin``) and Knative's
rules (``knative_rules``). The operator benchmark that runs on the emulator (``elastune bench operator``)
is in the benchmarks package (``elastune_bench.control.reconcile``).

The emulator needs the dev extras (kmock is a dev dependency), so nothing is imported until asked for:
`import elastune_testing` always works, `from elastune_testing import start_emulator`
raises a clear ImportError without them. Lazy loading also keeps `python -m
elastune_testing.emulator` from importing its own module twice.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastune_testing.emulator import (
        ApiServerEmulator,
        EmulatorHandle,
        start_emulator,
        write_kubeconfig,
    )

__all__ = ["ApiServerEmulator", "EmulatorHandle", "start_emulator", "write_kubeconfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("elastune_testing.emulator"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
