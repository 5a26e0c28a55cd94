"""The mixed workload (issue 13): a tuning trace and an inference trace on the same pools, simulated with
and without co-serving — through the live scheduler's own co-serving path.

Each LLM keeps ``serving_pods`` warm pods for inference the whole time (in the warm pool from the start,
paid in both runs); their utilisation follows a seeded per-minute trace around a mean (gamma-distributed
minute weights, like the tuning arrivals). Every round the environment reports the pods' co-serving
rates to the scheduler as the operator does (``ClusterState.coserve_rate``: the pod's peak utilisation of
the last minute through the co-serving model, floored to its step), and PromptTuner's Algorithm 1 offers
them to co-servable jobs whose predicted co-served time meets their SLO (``PromptTunerPolicy._coserve``);
everything else goes through the warm pool and the cold pool as before. Without co-serving no job is
co-servable, so the serving pods only serve.

Physics: a job on serving pods progresses at the slowest member's rate at each minute's real utilisation
(``coserving.coserved_finish``), which can be slower than predicted when a burst comes — the job then
misses. Its iteration time is learned apart (``Estimator.observe_coserved_iteration``), as the workers
report it live. Inference SLOs are not simulated: the engine's token budget keeps every iteration within
the TPOT target by construction (tested on the real engine, ``bench coserve``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from elastune_operator.scheduling.coserving import CoServeModel, coserved_finish, floored_rate
from elastune_operator.scheduling.estimator import Estimator
from elastune_operator.scheduling.factory import make_policy
from elastune_operator.scheduling.policy import PolicyName, PoolLimits
from elastune_operator.scheduling.state import Job

from .simulator import SimConfig, Simulator, _Run
from .workload import SimJob, SimLLM, WorkloadConfig, generate

STEP_SECONDS = 60.0


@dataclass(frozen=True)
class InferenceLoad:
    """One serving pod's inference utilisation, piecewise constant per ``step_seconds``."""

    utilization: tuple[float, ...]
    step_seconds: float = STEP_SECONDS

    def at(self, t: float) -> float:
        i = int(max(t, 0.0) // self.step_seconds)
        return self.utilization[min(i, len(self.utilization) - 1)]

    def peak(self, t: float, window: float = STEP_SECONDS) -> float:
        """The highest utilisation over ``[t - window, t]`` (what a pod's last minute of reports shows)."""
        return max(self.at(t), self.at(t - window))


def inference_trace(minutes: int, mean: float, burstiness: float, rng: np.random.Generator) -> InferenceLoad:
    """Per-minute utilisation: mean × gamma(burstiness) weights, clipped to [0.02, 0.98]."""
    w = rng.gamma(burstiness, 1.0 / burstiness, size=max(1, minutes))
    return InferenceLoad(tuple(float(x) for x in np.clip(mean * w, 0.02, 0.98)))


@dataclass(frozen=True)
class MixedConfig:
    serving_pods: int = 2
    """Warm inference pods per LLM."""
    mean_utilization: float = 0.5
    burstiness: float = 1.5
    model: CoServeModel = field(default_factory=CoServeModel)
    policy: PolicyName = "promptTuner"


@dataclass(frozen=True)
class MixedResult:
    slo_violation_pct: float
    cost_usd: float
    """Serving pods + the tuning pools."""
    serving_cost_usd: float
    tuning_cost_usd: float
    jobs: int
    coserved_jobs: int
    coserved_violations: int

    def summary(self) -> dict[str, float | int]:
        return {
            "slo_violation_pct": round(self.slo_violation_pct, 2),
            "cost_usd": round(self.cost_usd, 2),
            "serving_cost_usd": round(self.serving_cost_usd, 2),
            "tuning_cost_usd": round(self.tuning_cost_usd, 2),
            "jobs": self.jobs,
            "coserved_jobs": self.coserved_jobs,
            "coserved_violations": self.coserved_violations,
        }


class MixedSimulator(Simulator):
    """The simulator with serving pods: warm from the start, reported to the policy each round with
    their co-serving rates, and co-served jobs progressing at their pods' real rates."""

    def __init__(
        self,
        llms: dict[str, SimLLM],
        jobs: list[SimJob],
        loads: dict[str, list[InferenceLoad]],
        cfg: MixedConfig,
        coserve: bool,
        sim: SimConfig,
    ) -> None:
        estimator = Estimator([m.profile for m in llms.values()])
        pods = sum(len(v) for v in loads.values())
        # The serving pods come on top of the tuning cluster's cold pool, as they did before co-serving.
        super().__init__(
            llms,
            jobs,
            make_policy(cfg.policy, estimator),
            replace(sim, cold_capacity=sim.cold_capacity + pods),
        )
        self.loads, self.model, self.coserve = loads, cfg.model, coserve
        self.pod_load: dict[int, InferenceLoad] = {}
        self.coserved: dict[str, float] = {}
        """Co-served job -> its deadline (violations among them are reported apart)."""
        self._minute = -1

    def _setup(self) -> None:
        for llm, loads in self.loads.items():
            # The pool never shrinks below its serving pods (the operator's serving need does the same).
            self.policy.set_pool_limits(llm, PoolLimits(min_warm=len(loads)))
            for load in loads:
                gpu = self.state.launch(llm, 0.0)
                self.state.gpu_ready(gpu.id, 0.0)
                self.pod_load[gpu.id] = load

    def _make_job(self, sj: SimJob) -> Job:
        job = super()._make_job(sj)
        job.coservable = self.coserve  # the traces' jobs are prompt tuning without a target metric
        return job

    def _before_round(self, now: float) -> None:
        minute = int(now // STEP_SECONDS)
        if minute != self._minute:  # the traces change per minute: report once per minute
            self._minute = minute
            rates = {g: floored_rate(self.model, load.peak(now)) for g, load in self.pod_load.items()}
            self.state.set_coserve_rates(rates)

    def _rate_at(self, gpus: list[int]) -> Callable[[float], float]:
        """The gang's co-serving rate over time: its slowest serving pod's (dedicated members run at 1)."""
        pods = [self.pod_load[g] for g in gpus if g in self.pod_load]

        def rate(t: float) -> float:
            return min(self.model.rate(p.at(t)) for p in pods)

        return rate

    def _run_until(self, job: Job, start: float, seconds: float) -> float:
        if not any(g in self.pod_load for g in job.gpus):
            return start + seconds
        self.coserved[job.id] = job.deadline
        end = coserved_finish(start, seconds, self._rate_at(job.gpus), STEP_SECONDS, self.cfg.max_seconds)
        return end if end is not None else self.cfg.max_seconds + 1.0

    def _observe_finished(self, job: Job, run: _Run, t: float) -> None:
        if job.id not in self.coserved:
            super()._observe_finished(job, run, t)
            return
        iterations = self._true_iterations(run, job)
        if iterations > 0 and t > run.iter_start:
            self.policy.estimator.observe_coserved_iteration(job.llm, (t - run.iter_start) / iterations)


def run_mixed(workload: WorkloadConfig, sim: SimConfig, cfg: MixedConfig, coserve: bool) -> MixedResult:
    jobs = generate(workload)
    rng = np.random.default_rng(workload.seed + 104729)
    loads = {
        llm: [
            inference_trace(workload.minutes, cfg.mean_utilization, cfg.burstiness, rng)
            for _ in range(cfg.serving_pods)
        ]
        for llm in workload.llms
    }
    simulator = MixedSimulator(workload.llms, jobs, loads, cfg, coserve, sim)
    result = simulator.run()
    pods = sum(len(v) for v in loads.values())
    serving = pods * result.makespan_seconds / 3600.0 * sim.price_per_gpu_hour
    finished = {j.id: j.finished_at for j in simulator.state.jobs.values()}
    late = sum(
        1
        for jid, deadline in simulator.coserved.items()
        if (finished.get(jid) or float("inf")) > deadline + 1e-9
    )
    return MixedResult(
        slo_violation_pct=result.slo_violation_pct,
        cost_usd=result.cost_usd,
        serving_cost_usd=serving,
        tuning_cost_usd=result.cost_usd - serving,
        jobs=len(jobs),
        coserved_jobs=len(simulator.coserved),
        coserved_violations=late,
    )


def with_and_without(
    workload: WorkloadConfig, sim: SimConfig, cfg: MixedConfig, seeds: list[int]
) -> dict[str, dict[str, float]]:
    """Seed means of both runs: ``{"with_coserving": {...}, "without_coserving": {...}}``."""
    out: dict[str, dict[str, float]] = {}
    for key, on in (("with_coserving", True), ("without_coserving", False)):
        runs = [run_mixed(replace(workload, seed=s), replace(sim, seed=s), cfg, on).summary() for s in seeds]
        out[key] = {k: round(float(np.mean([r[k] for r in runs])), 2) for k in runs[0]}
    return out
