"""Which CPUs the engine's torch threads run on, and which are left to the HTTP front end.

On a CPU engine a step is ~100 small kernels: torch's OpenMP threads that sleep between them
(``OMP_WAIT_POLICY=PASSIVE``, which the project sets so processes sharing cores do not spin) pay a
wake-up on every kernel, and unbound threads share cores with the front end's event loop and the
clients. vLLM-CPU's answer (``VLLM_CPU_OMP_THREADS_BIND=auto``) is ours: the engine process is bound to
all CPUs but one, with one torch thread per CPU, and the last CPU is reserved for the front end (the
API process, which parses requests and writes the SSE chunks). The serving-only server does this by
default and binds its front end to the reserved CPU; the worker does not by default (every worker on a
host would take the same CPUs, and its tuning runs in its front-end process).

Specs: ``auto`` (bind when at least two CPUs are usable, no CPU quota below them — a container
limited by a CFS quota rather than a cpuset keeps torch's default — and the engine runs on the CPU),
``none`` (no binding, torch's default threads), or an explicit list such as ``0-2,5`` (the engine's
CPUs; the front end gets the others, or shares them when none are left).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuPlan:
    engine: tuple[int, ...]
    """CPUs the engine process runs on (one torch thread each)."""
    frontend: tuple[int, ...]
    """CPUs the API process keeps (the engine's too when nothing is left over)."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0-2,5`` -> (0, 1, 2, 5); ValueError with the offending part otherwise."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-2,5)") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU range: {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def validate_spec(spec: str) -> str:
    """The spec unchanged, or ValueError saying what is wrong (for argparse and configs)."""
    if spec not in ("auto", "none"):
        parse_cpu_list(spec)
    return spec


def plan_cpus(spec: str, usable: set[int] | frozenset[int], quota: float | None = None) -> CpuPlan | None:
    """The binding for ``spec`` given the CPUs this process may use and its CPU quota (in CPUs; None:
    unlimited); None: do not bind."""
    if spec == "none":
        return None
    if spec == "auto":
        # Under a quota smaller than the CPUs it may run on (a Kubernetes CPU limit without the static
        # CPU manager), binding one thread per usable CPU would oversubscribe the quota.
        if len(usable) < 2 or (quota is not None and quota < len(usable)):
            return None
        ordered = sorted(usable)
        # vLLM-CPU reserves the last CPU(s) for its front end as well.
        return CpuPlan(engine=tuple(ordered[:-1]), frontend=(ordered[-1],))
    engine = parse_cpu_list(spec)
    outside = set(engine) - set(usable)
    if outside:
        raise ValueError(f"engine CPUs {sorted(outside)} are not usable here (usable: {sorted(usable)})")
    rest = tuple(sorted(set(usable) - set(engine)))
    return CpuPlan(engine=engine, frontend=rest or engine)


def plan_here(spec: str) -> CpuPlan | None:
    """``plan_cpus`` for this process: its usable CPUs and its container's quota."""
    return plan_cpus(spec, usable_cpus(), cpu_quota())


def cpu_quota(cgroup_root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """This container's CFS CPU quota in CPUs (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or
    None when there is none (or it cannot be read)."""
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        q_period = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if q <= 0 else q / q_period
    except (OSError, ValueError):
        return None


def usable_cpus() -> frozenset[int]:
    """CPUs this process may run on (its affinity mask: a container's cpuset, taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


_before_binding: frozenset[int] | None = None


def unbound_cpus() -> frozenset[int]:
    """The CPUs this process could use before ``bind_process`` (its helper processes, such as
    CaraServe's CPU LoRA workers, run there rather than on the engine's CPUs)."""
    return _before_binding if _before_binding is not None else usable_cpus()


def bind_process(cpus: tuple[int, ...]) -> bool:
    """Bind every thread of this process to ``cpus`` (threads started later inherit their starter's
    binding, torch's OpenMP pool included); False where the platform cannot."""
    global _before_binding
    if not hasattr(os, "sched_setaffinity"):
        return False
    if _before_binding is None:
        _before_binding = usable_cpus()
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cpus)
    return True
