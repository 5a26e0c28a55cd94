"""The mixed workload (issue 13): a tuning trace and an inference trace on the same pools, simulated with
and without co-serving.

Each LLM keeps ``serving_pods`` warm pods for inference the whole time (paid in both runs); their
utilisation follows a seeded per-minute trace around a mean (gamma-distributed minute weights, like the
tuning arrivals). Without co-serving every TuningJob goes through the PromptTuner scheduler and the
cold pool, as today. With co-serving a job arriving when a serving pod of its LLM is free of co-served
work is offered to ``scheduling.coserving.choose_pod``: if the pod's current utilisation predicts it
finishes within the safety share of its SLO it runs there — its real finish follows the pod's changing
utilisation, so it can still miss — and it costs no GPU of its own; the other jobs run through the
scheduler exactly as before. Inference SLOs are not simulated: the engine's token budget keeps every
iteration within the TPOT target by construction (tested on the real engine, `bench coserve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..scheduling.coserving import CoServeModel, ServingPod, choose_pod, coserved_finish
from ..scheduling.estimator import Estimator, model_iteration_seconds
from ..scheduling.factory import make_policy
from ..scheduling.policy import PolicyName
from .simulator import SimConfig, Simulator
from .workload import SimJob, WorkloadConfig, generate

STEP_SECONDS = 60.0


@dataclass(frozen=True)
class InferenceLoad:
    """One serving pod's inference utilisation, piecewise constant per ``step_seconds``."""

    utilization: tuple[float, ...]
    step_seconds: float = STEP_SECONDS

    def at(self, t: float) -> float:
        return self.utilization[min(int(t // self.step_seconds), len(self.utilization) - 1)]


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


def run_mixed(workload: WorkloadConfig, sim: SimConfig, cfg: MixedConfig, coserve: bool) -> MixedResult:
    jobs = generate(workload)
    rng = np.random.default_rng(workload.seed + 104729)
    loads = {
        (llm, i): inference_trace(workload.minutes, cfg.mean_utilization, cfg.burstiness, rng)
        for llm in workload.llms
        for i in range(cfg.serving_pods)
    }
    horizon = sim.max_seconds
    busy_until = dict.fromkeys(loads, 0.0)
    rest: list[SimJob] = []
    coserved = violations = 0
    for j in jobs:
        llm = workload.llms[j.llm]
        if not coserve:
            rest.append(j)
            continue
        pods = [
            ServingPod(
                f"{name}-{i}", name, loads[(name, i)].at(j.arrival), busy_until[(name, i)] <= j.arrival
            )
            for (name, i) in loads
            if name == j.llm
        ]
        # What the scheduler knows: the configured profile, the job's iteration limit, the warm overhead.
        predicted = llm.profile.warm_overhead_seconds + j.max_iterations * model_iteration_seconds(
            llm.profile, 1
        )
        choice = choose_pod(j.llm, 1, predicted, j.slo, pods, cfg.model)
        if choice.pod is None:
            rest.append(j)
            continue
        i = int(choice.pod.rsplit("-", 1)[1])
        real = llm.profile.warm_overhead_seconds + j.iterations * llm.true_iteration_seconds(1)
        finish = coserved_finish(j.arrival, real, loads[(j.llm, i)].at, cfg.model, STEP_SECONDS, horizon)
        busy_until[(j.llm, i)] = finish if finish is not None else horizon
        coserved += 1
        violations += finish is None or finish > j.arrival + j.slo + 1e-9
    estimator = Estimator([m.profile for m in workload.llms.values()])
    result = Simulator(workload.llms, rest, make_policy(cfg.policy, estimator), sim).run()
    makespan = max(result.makespan_seconds, workload.minutes * 60.0)
    serving = len(loads) * makespan / 3600.0 * sim.price_per_gpu_hour
    total_violations = result.slo_violations + violations
    return MixedResult(
        slo_violation_pct=100.0 * total_violations / len(jobs) if jobs else 0.0,
        cost_usd=serving + result.cost_usd,
        serving_cost_usd=serving,
        tuning_cost_usd=result.cost_usd,
        jobs=len(jobs),
        coserved_jobs=coserved,
        coserved_violations=violations,
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
