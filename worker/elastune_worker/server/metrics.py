"""Prometheus metrics of one worker process (served on /metrics); names as in operator metrics.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ready = Gauge(
            "elastune_worker_ready", "1 once the runtime and weights are loaded (warm).", registry=r
        )
        self.busy = Gauge("elastune_worker_busy", "1 while the worker runs a job.", registry=r)
        self.model_load = Gauge(
            "elastune_worker_model_load_seconds",
            "Seconds it took to load the runtime and weights.",
            registry=r,
        )
        self.jobs = Counter(
            "elastune_worker_jobs",
            "Job assignments this worker ended, by outcome (succeeded | failed | cancelled).",
            ["outcome"],
            registry=r,
        )
        self.steps = Counter("elastune_worker_steps", "Optimizer steps run.", registry=r)
        self.credential_refused = Counter(
            "elastune_worker_request_credential_refused",
            "Inference requests refused for their gateway credential, by reason (missing | malformed | "
            "signature | expired | namespace | model).",
            ["reason"],
            registry=r,
        )
        self.compute = Histogram(
            "elastune_worker_step_compute_seconds",
            "Per-step forward, backward and optimizer time.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.sync = Histogram(
            "elastune_worker_step_sync_seconds",
            "Per-step gradient all-reduce time through the storage channel.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
