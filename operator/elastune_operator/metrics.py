"""Prometheus metrics of the control plane (operator and `elastune run`), one registry per process.

Names follow Prometheus conventions: ``elastune_`` prefix, base units (seconds), ``_total`` on
counters. Labels are bounded: ``model`` is a WarmPool's LLM (a handful per cluster) and
``pool_namespace`` the namespace of that WarmPool (two namespaces' pools of one model are two series;
not ``namespace``, which the chart's ServiceMonitor keeps for the scrape target with honorLabels; ""
for a job failed before a pool was chosen); job names are never labels. The Grafana dashboards in
``helm/elastune/dashboards`` query exactly these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Job latency from creation to completion; buckets from seconds (tiny local jobs) to hours.
JOB_LATENCY_BUCKETS = (5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
#: Scheduling rounds take < 1 ms at 1,000 GPUs in the simulator (README); buckets in seconds.
ROUND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
#: Allocation overhead T_cold: container start + weights load, seconds to minutes.
COLD_START_BUCKETS = (1, 2, 5, 10, 20, 30, 45, 60, 90, 120, 300)
BANK_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60)


class ControlMetrics:
    """All control-plane metrics, registered on ``registry`` (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.jobs_submitted = Counter(
            "elastune_tuningjobs_submitted",
            "TuningJobs accepted by the control plane.",
            ["model", "pool_namespace"],
            registry=r,
        )
        self.jobs_finished = Counter(
            "elastune_tuningjobs_finished",
            "TuningJobs that ended, by outcome (succeeded | failed | cancelled).",
            ["model", "pool_namespace", "outcome"],
            registry=r,
        )
        self.slo = Counter(
            "elastune_tuningjob_slo",
            "Finished TuningJobs by whether their deadline (SLO) was met (result = met | missed).",
            ["model", "pool_namespace", "result"],
            registry=r,
        )
        self.job_latency = Histogram(
            "elastune_tuningjob_latency_seconds",
            "Seconds from a TuningJob's creation to its completion.",
            ["model", "pool_namespace"],
            buckets=JOB_LATENCY_BUCKETS,
            registry=r,
        )
        self.pending = Gauge(
            "elastune_tuningjobs_pending",
            "TuningJobs waiting for GPUs.",
            ["model", "pool_namespace"],
            registry=r,
        )
        self.gpus = Gauge(
            "elastune_warm_gpus",
            "GPUs in a model's warm pool by state (starting | idle | held | busy).",
            ["model", "pool_namespace", "state"],
            registry=r,
        )
        self.cold_free = Gauge(
            "elastune_cold_pool_free_gpus", "GPUs left in the shared cold pool.", registry=r
        )
        self.cold_start = Histogram(
            "elastune_allocation_overhead_seconds",
            "Measured T_cold: seconds from taking a GPU from the cold pool to a ready (warm) worker.",
            ["model", "pool_namespace"],
            buckets=COLD_START_BUCKETS,
            registry=r,
        )
        self.round_time = Histogram(
            "elastune_scheduling_round_duration_seconds",
            "Wall time of one scheduling round (Algorithms 1 and 2).",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.bank_lookups = Counter(
            "elastune_prompt_bank_lookups",
            "Prompt Bank decisions per job (result = used | skipped | failed).",
            ["model", "pool_namespace", "result"],
            registry=r,
        )
        self.bank_latency = Histogram(
            "elastune_prompt_bank_lookup_duration_seconds",
            "Wall time of a Prompt Bank lookup.",
            ["model", "pool_namespace"],
            buckets=BANK_BUCKETS,
            registry=r,
        )
        self.gpu_seconds = Counter(
            "elastune_gpu_seconds",
            "GPU-seconds paid in warm pools (busy or idle): the cost measure of the paper.",
            ["model", "pool_namespace"],
            registry=r,
        )
        self.attempts = Counter(
            "elastune_tuningjob_attempts_started",
            "TuningJob attempts dispatched to workers, by placement (dedicated | coserved: beside "
            "inference on serving pods, FlexLLM).",
            ["model", "pool_namespace", "placement"],
            registry=r,
        )
        self.handler_errors = Counter(
            "elastune_handler_errors",
            "Unexpected errors in reconcile handlers (the object is retried, the operator keeps running).",
            ["handler"],
            registry=r,
        )
        self.poison_records = Counter(
            "elastune_control_poison_records",
            "Malformed registry entries the control plane skipped (each counted once), by kind (worker | "
            "pool | placement | demand | event | assignment): the round goes on without them.",
            ["kind"],
            registry=r,
        )
        self.unvouched = Counter(
            "elastune_control_unvouched_records",
            "Registry records and job events the control plane ignored because no pod of their pool (or "
            "no worker of the attempt) matches them, by kind (worker | event): each worker id once.",
            ["kind"],
            registry=r,
        )
        self.reasserts = Counter(
            "elastune_control_reasserts",
            "Times the control plane rewrote what it owns in the registry (pool records, placements), by "
            "why (periodic | reconnect | lost: Redis came back without them).",
            ["why"],
            registry=r,
        )
        self.workers_returned = Counter(
            "elastune_control_workers_returned",
            "Workers considered gone (registry record expired) that registered again and were used again.",
            ["model", "pool_namespace"],
            registry=r,
        )
