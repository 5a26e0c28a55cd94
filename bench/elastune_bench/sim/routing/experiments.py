"""The simulator's experiments: a workload, a pool of endpoints and a policy, with documented defaults.

Defaults per workload (each one overridable; ``Experiment.describe`` prints what ran):

- prefix (Preble §5): 8 shared documents of 1,500–4,000 tokens per endpoint behind a 200-token system
  prompt, Zipf 1.1 popularity, 20–200-token questions, 8–64-token answers (Toolbench-like: prompt
  ~3,000 tokens, ~40× the output); 3 requests/s per endpoint (Poisson) for 150 s; 32,768 KV tokens per
  endpoint (about 10 documents), so a policy that spreads every document everywhere thrashes the
  caches and one that partitions them does not — Preble's setting (long, shared prompts; more shared
  state than one GPU holds). 3 requests/s per endpoint is where round-robin nears saturation.
- multiturn: ShareGPT conversations of 1–5 turns, 5 s mean think time, 0.1 conversations/s per
  endpoint, 32,768 KV tokens per endpoint.
- lora (CaraServe §7.5): 60 servers, 1,000 adapters of ranks {8, 16, 32, 64} with Zipf 1.0
  popularity, 32 adapters on each device, 32–512-token prompts, 16–256-token answers, a 50 ms TPOT
  SLO, 5 requests/s per server for 20 s, the padded (BGMV) kernel.

Statistics leave out the first 10 % of requests by arrival (``warmup``): every run starts with cold
prefix caches and empty adapter slots.

Every endpoint has the same ``CostModel`` — the placeholders of ``routing/cost.py`` until the fitted
figures of the real engine replace them (pass ``cost``). The local queue is Preble's priority groups
for the ``preble`` policy (its local scheduler) and FCFS for the others, unless ``local_queue`` says;
every engine chunks prefills at 512 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from elastune_gateway.routing.cost import CostModel, LoraKernel
from elastune_gateway.routing.factory import RouterConfig, make_router
from elastune_gateway.routing.policy import RoutingPolicyName

from .engine import EngineSpec, LocalQueue
from .simulator import OutputPrediction, SimResult, Simulator
from .workloads import (
    LoraWorkload,
    MultiTurnWorkload,
    PrefixWorkload,
    SimRequest,
    adapter_ranks,
    azure_trace,
    load_sharegpt,
    lora_workload,
    multiturn_workload,
    poisson_arrivals,
    prefix_workload,
)

Workload = Literal["prefix", "multiturn", "lora"]
WORKLOADS: tuple[Workload, ...] = ("prefix", "multiturn", "lora")
DEFAULT_POLICIES: dict[Workload, tuple[RoutingPolicyName, ...]] = {
    "prefix": ("roundRobin", "leastLoad", "preble", "combined"),
    "multiturn": ("roundRobin", "leastLoad", "preble", "combined"),
    "lora": ("rankAware", "mostIdle", "firstFit", "random", "combined"),
}


@dataclass(frozen=True, slots=True)
class Experiment:
    workload: Workload = "prefix"
    endpoints: int | None = None
    requests: int | None = None
    """Requests (prefix, lora) or conversations (multiturn); None: the workload's default."""
    rate: float | None = None
    """Poisson arrivals per second for the whole pool (None: the default per endpoint × endpoints)."""
    arrivals: Literal["poisson", "azure"] = "poisson"
    trace: str | None = None
    """The Azure trace's CSV (gzipped or not); None: the repository's ``data/azure_llm_conv_2023.csv.gz``."""
    trace_scale: float = 1.0
    trace_lengths: bool = False
    sharegpt: str | None = None
    """ShareGPT entries for multiturn; None: ``$ELASTUNE_DATASET`` or ``data/sharegpt_250.json.gz``."""
    documents: int | None = None
    zipf: float | None = None
    adapters: int | None = None
    tpot_slo: float | None = None
    kv_tokens: int | None = None
    max_adapters: int | None = None
    lora_kernel: LoraKernel | None = None
    local_queue: Literal["auto", "fcfs", "priority"] = "auto"
    predict_output: OutputPrediction = "none"
    warmup: float = 0.1
    """Fraction of requests (by arrival) left out of the statistics."""
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)

    @property
    def n_endpoints(self) -> int:
        return self.endpoints or (60 if self.workload == "lora" else 8)

    @property
    def n_requests(self) -> int:
        if self.requests is not None:
            return self.requests
        if self.workload == "multiturn":
            return 25 * self.n_endpoints
        seconds = 150.0 if self.workload == "prefix" else 20.0
        return max(1, round(self.pool_rate * seconds))

    @property
    def pool_rate(self) -> float:
        if self.rate is not None:
            return self.rate
        per = {"prefix": 3.0, "multiturn": 0.1, "lora": 5.0}[self.workload]
        return per * self.n_endpoints

    def engine(self, policy: RoutingPolicyName) -> EngineSpec:
        cost = self.cost if self.lora_kernel is None else replace(self.cost, lora_kernel=self.lora_kernel)
        queue: LocalQueue
        if self.local_queue == "auto":
            queue = "priority" if policy == "preble" else "fcfs"
        else:
            queue = self.local_queue
        max_adapters = self.max_adapters or (32 if self.workload == "lora" else EngineSpec().max_adapters)
        return EngineSpec(
            cost=cost, kv_cache_tokens=self.kv_tokens or 32_768, queue=queue, max_adapters=max_adapters
        )

    def _arrival_times(self, n: int) -> tuple[list[float], list[tuple[int, int]] | None]:
        if self.arrivals == "azure":
            rows = azure_trace(self.trace, limit=n, time_scale=self.trace_scale)
            return [r.arrival for r in rows], [(r.context_tokens, r.generated_tokens) for r in rows]
        return poisson_arrivals(n, self.pool_rate, seed=self.seed + 1), None

    def build(self) -> list[SimRequest]:
        """The workload's requests (first turns for multiturn), fresh each call."""
        n = self.n_requests
        times, lengths = self._arrival_times(n)
        if self.workload == "prefix":
            w = PrefixWorkload(requests=n, documents=self.documents or 8 * self.n_endpoints, seed=self.seed)
            if self.zipf is not None:
                w = replace(w, zipf=self.zipf)
            return prefix_workload(w, times)
        if self.workload == "multiturn":
            mt = MultiTurnWorkload(conversations=n, seed=self.seed)
            return multiturn_workload(mt, load_sharegpt(self.sharegpt), times)
        lw = LoraWorkload(requests=n, seed=self.seed)
        if self.adapters is not None:
            lw = replace(lw, adapters=self.adapters)
        if self.zipf is not None:
            lw = replace(lw, zipf=self.zipf)
        if self.tpot_slo is not None:
            lw = replace(lw, tpot_slo=self.tpot_slo)
        capped = (
            [(min(p, 4096), min(o, 1024)) for p, o in lengths] if lengths and self.trace_lengths else None
        )
        return lora_workload(lw, times, capped)

    def describe(self) -> str:
        kernel = self.lora_kernel or self.cost.lora_kernel
        arrivals = (
            f"azure trace ×{self.trace_scale}"
            if self.arrivals == "azure"
            else f"Poisson {self.pool_rate:g}/s"
        )
        count = "conversations" if self.workload == "multiturn" else "requests"
        text = (
            f"workload={self.workload} endpoints={self.n_endpoints} {count}={self.n_requests} "
            f"arrivals={arrivals} kv_tokens={self.kv_tokens or 32_768} warmup={self.warmup:g} "
            f"seed={self.seed}"
        )
        if self.workload == "prefix":
            text += f" documents={self.documents or 8 * self.n_endpoints} zipf={self.zipf or 1.1}"
        if self.workload == "lora":
            text += (
                f" adapters={self.adapters or 1000} zipf={self.zipf or 1.0} kernel={kernel}"
                f" max_adapters={self.engine('rankAware').max_adapters}"
                f" tpot_slo={self.tpot_slo or LoraWorkload().tpot_slo}"
            )
        return text + " (cost model: placeholder coefficients, routing/cost.py)"


def run_experiment(
    exp: Experiment, policy: RoutingPolicyName, config: RouterConfig | None = None, check: bool = False
) -> SimResult:
    requests = exp.build()
    sim = Simulator(
        make_router(policy, config),
        [exp.engine(policy)] * exp.n_endpoints,
        adapter_ranks(requests),
        predict_output=exp.predict_output,
        check=check,
    )
    return sim.run(requests, label=policy, warmup=exp.warmup)
