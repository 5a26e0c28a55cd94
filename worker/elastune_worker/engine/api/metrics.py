"""Serving metrics with the names routers scrape (the Gateway API Inference Extension's model-server
protocol, vLLM's ``vllm:`` names) plus Elastune's own ``elastune_`` ones.

Latency histograms are observed by the API as requests stream; the gauges and the prefix-cache and
preemption counters are read from the engine's stats at scrape time, so they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from elastune_worker.engine.client import LoRAInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Time per output token after the first.", labels,
            buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=registry
        )
        self.finished = Counter(
            "vllm:request_success", "Finished requests by reason.", [*labels, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self.errors = Counter(
            "elastune_serving_errors", "Requests answered with an error, by HTTP status.", [*labels, "code"],
            registry=registry,
        )  # fmt: skip
        self.adapter_loads = Counter(
            "elastune_lora_adapter_loads", "load_lora_adapter calls, by outcome (ok, failed)",
            [*labels, "outcome"], registry=registry,
        )  # fmt: skip

    def watch_engine(
        self,
        registry: CollectorRegistry,
        stats: Callable[[], dict[str, float] | None],
        lora_info: Callable[[], LoRAInfo | None] | None = None,
    ) -> None:
        registry.register(_EngineStats(self.model, stats))
        if lora_info is not None:
            registry.register(_LoRAStats(self.model, stats, lora_info))

    def request_done(
        self, ttft: float | None, e2e: float, tokens: int, prompt_tokens: int, reason: str
    ) -> None:
        m = self.model
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
            if tokens > 1:
                self.tpot.labels(m).observe((e2e - ttft) / (tokens - 1))
        self.e2e.labels(m).observe(e2e)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(tokens)
        self.finished.labels(m, reason).inc()


class _EngineStats(Collector):
    def __init__(self, model: str, stats: Callable[[], dict[str, float] | None]) -> None:
        self.model, self.stats = model, stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats() or {}
        gauges = {
            "vllm:num_requests_running": ("Requests in the running batch.", "num_requests_running"),
            "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", "num_requests_waiting"),
            "vllm:kv_cache_usage_perc": ("KV-cache usage (1 = full).", "kv_cache_usage_perc"),
        }
        for name, (doc, key) in gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model], float(s.get(key, 0.0)))
            yield g
        counters = {
            "elastune_prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache.",
                "prefix_cache_queries_tokens",
            ),
            "elastune_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache.",
                "prefix_cache_hits_tokens",
            ),
            "elastune_preemptions": (
                "Requests preempted (recomputed) when KV blocks ran out.",
                "preemptions",
            ),
            # rate() of the first is the engine's busy fraction; of the second, the share of it that
            # co-served finetuning took (FlexLLM): what co-serving costs inference, per pod.
            "elastune_engine_busy_seconds": (
                "Seconds the engine spent in steps (inference and co-served finetuning).",
                "step_seconds",
            ),
            "elastune_coserve_finetune_seconds": (
                "Of the engine's step seconds, those spent on co-served finetuning.",
                "coserve_seconds",
            ),
        }
        for name, (doc, key) in counters.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model], float(s.get(key, 0.0)))
            yield c


class _LoRAStats(Collector):
    """Adapter residency, loads and evictions by tier, CPU-assisted steps, and vLLM's
    ``vllm:lora_requests_info`` (a gauge whose labels name the adapters of running and waiting requests,
    comma-separated, and ``max_lora``; its value is the scrape's Unix time, as vLLM sets it)."""

    def __init__(
        self,
        model: str,
        stats: Callable[[], dict[str, float] | None],
        info: Callable[[], LoRAInfo | None],
    ) -> None:
        self.model, self.stats, self.info = model, stats, info

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = self.info()
        if info is None or info.max_loras == 0:
            return
        s = self.stats() or {}
        req = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
        )
        req.add_metric([",".join(info.running), str(info.max_loras), ",".join(info.waiting)], time.time())
        yield req
        resident = GaugeMetricFamily(
            "elastune_lora_adapters_resident", "LoRA adapters held per tier (device slots, host memory).",
            labels=["model_name", "tier"],
        )  # fmt: skip
        for tier, n in sorted(info.resident.items()):
            resident.add_metric([self.model, tier], float(n))
        yield resident
        per_tier = {
            "elastune_lora_tier_loads": (
                "Adapter loads into a tier (host: from storage; device: copies).",
                "loads",
            ),
            "elastune_lora_tier_load_seconds": (
                "Seconds spent loading adapters into a tier.",
                "load_seconds",
            ),
            "elastune_lora_evictions": ("Adapters evicted from a tier by LRU.", "evictions"),
        }
        for name, (doc, key) in per_tier.items():
            c = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
            for tier in ("device", "host"):
                c.add_metric([self.model, tier], s.get(f"lora_{tier}_{key}", 0.0))
            yield c
        cpu_assisted = {
            "elastune_lora_cpu_assisted_steps": (
                "Engine steps whose cold adapters' deltas ran on the CPU while their copy was in flight "
                "(CaraServe's CPU-assisted prefill).",
                "lora_cpu_assisted_steps",
            ),
            "elastune_lora_cpu_assisted_prefills": (
                "Requests whose prefill ran (at least in part) with their adapter's delta computed on the "
                "CPU while its copy to the device was in flight (CaraServe).",
                "lora_cpu_assisted_prefills",
            ),
        }
        for name, (doc, key) in cpu_assisted.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model], s.get(key, 0.0))
            yield c
