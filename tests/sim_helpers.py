"""The small three-LLM simulator trace the simulator and spend tests share."""

from __future__ import annotations

from elastune_bench.sim.scheduling.simulator import SimConfig, SimResult, Simulator
from elastune_bench.sim.scheduling.workload import WorkloadConfig, generate
from elastune_operator.scheduling.estimator import Estimator
from elastune_operator.scheduling.factory import PolicyConfig, make_policy
from elastune_operator.scheduling.policy import PolicyName

SMALL = {"gpt2-base": 6, "gpt2-large": 5, "vicuna-7b": 4}


def small_workload(seed: int) -> WorkloadConfig:
    return WorkloadConfig(jobs_per_llm=dict(SMALL), minutes=3, duration_bounds=(5.0, 60.0), seed=seed)


def run(policy: PolicyName, seed: int, config: PolicyConfig | None = None) -> tuple[Simulator, SimResult]:
    wl = small_workload(seed)
    est = Estimator([llm.profile for llm in wl.llms.values()])
    sim = Simulator(
        wl.llms, generate(wl), make_policy(policy, est, config), SimConfig(cold_capacity=16, seed=seed)
    )
    return sim, sim.run()
