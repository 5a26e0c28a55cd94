"""Where worker processes come from: the interface the Local backend implements today and the Knative
backend (one Knative Service per WarmPool, min-scale driven by Algorithm 2) implements next."""

from __future__ import annotations

from typing import NamedTuple, Protocol


class WorkerExit(NamedTuple):
    """How a worker went: its model, what happened (it reaches the job's condition message), and the
    reason when the platform names one (a pod's ImagePullBackOff, OOMKilled, ...; vocabulary constants)."""

    model: str
    detail: str
    reason: str | None = None
    pool: str = ""
    """The id (namespace/name) of the worker's pool ("": the backend does not say; the core takes the
    pool of its model)."""


class ClusterBackend(Protocol):
    def grow(self, pool: str, model: str, count: int) -> None:
        """Start ``count`` more workers for ``pool`` (GPUs leave the cold pool). They announce
        themselves through the protocol's registry once warm; the core binds them then."""
        ...

    def shrink(self, pool: str, worker_ids: list[str]) -> None:
        """Return these idle workers' GPUs to the cold pool. Only idle workers are ever named: the
        core never lets a scale-down pick a busy one. Workers that were lost or never came up are named
        too (their GPU went back to the cold pool): a pod Kubernetes still keeps, crash-looping or
        unschedulable, goes with them instead of holding a slot of the pool."""
        ...

    def mark_busy(self, pool: str, worker_ids: list[str], busy: bool) -> None:
        """Workers started (busy) or stopped running a job: lets the platform protect busy ones
        from a scale-down it picks itself (Knative: pod-deletion-cost)."""
        ...

    def exited(self) -> dict[str, WorkerExit]:
        """Workers known to be gone (or never to come: a pod that cannot start): id -> how. A faster
        signal than an expiring heartbeat, and the only one for a worker that died before it ever
        registered. A worker may be reported again; the fleet acts on the first report."""
        ...

    def close(self) -> None: ...
