"""What a simulation run reports: latency (mean, p99), TTFT, TPOT, SLO attainment, prefix-cache hits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .workloads import SimRequest

if TYPE_CHECKING:
    from .engine import SimEndpoint


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100), linear between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    endpoints: int
    requests: int
    mean_latency: float
    p99_latency: float
    mean_ttft: float
    p99_ttft: float
    mean_tpot: float
    p99_tpot: float
    slo_attainment: float | None
    """Share of requests with SLOs that met all of theirs (None: no request had one)."""
    cache_hit: float
    """Prompt tokens served from endpoint prefix caches / prompt tokens."""
    adapter_loads: int
    makespan: float
    utilization: float
    """Mean share of the run each endpoint spent in iterations."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(
    policy: str,
    endpoints: int,
    requests: Sequence[SimRequest],
    engines: Sequence[SimEndpoint] = (),
    warmup: float = 0.0,
) -> Summary:
    """Statistics over the finished requests, leaving out the first ``warmup`` fraction of them by
    arrival (cold caches: every policy starts with empty prefix caches and adapter slots)."""
    done = sorted((r for r in requests if r.finished is not None), key=lambda r: r.arrival)
    done = done[int(len(done) * warmup) :]
    latencies = [r.latency for r in done]
    ttfts = [r.ttft for r in done]
    tpots = [t for r in done if (t := r.tpot) is not None]
    slo = [m for r in done if (m := r.met_slo()) is not None]
    prompt = sum(r.prompt_len for r in done)
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.finished for r in done if r.finished is not None), default=0.0)
    makespan = end - start
    busy = sum(e.busy_seconds for e in engines)
    return Summary(
        policy=policy,
        endpoints=endpoints,
        requests=len(done),
        mean_latency=_mean(latencies),
        p99_latency=percentile(latencies, 99),
        mean_ttft=_mean(ttfts),
        p99_ttft=percentile(ttfts, 99),
        mean_tpot=_mean(tpots),
        p99_tpot=percentile(tpots, 99),
        slo_attainment=sum(slo) / len(slo) if slo else None,
        cache_hit=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        adapter_loads=sum(e.adapter_loads for e in engines),
        makespan=makespan,
        utilization=busy / (makespan * len(engines)) if engines and makespan > 0 else 0.0,
    )


COLUMNS = (
    ("policy", "policy", "{:<11}"),
    ("endpoints", "eps", "{:>4}"),
    ("requests", "reqs", "{:>6}"),
    ("mean_latency", "mean s", "{:>8.3f}"),
    ("p99_latency", "p99 s", "{:>8.3f}"),
    ("mean_ttft", "TTFT s", "{:>8.3f}"),
    ("p99_ttft", "p99TTFT", "{:>8.3f}"),
    ("mean_tpot", "TPOT ms", "{:>8.1f}"),
    ("p99_tpot", "p99TPOT", "{:>8.1f}"),
    ("slo_attainment", "SLO %", "{:>7}"),
    ("cache_hit", "hit %", "{:>6.1f}"),
    ("adapter_loads", "loads", "{:>6}"),
)


def table(rows: Sequence[Summary]) -> str:
    """A fixed-width table, one row per run."""
    head = " ".join(
        f"{title:>{_width(fmt)}}" if i else f"{title:<11}" for i, (_, title, fmt) in enumerate(COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = getattr(row, key)
            if key in ("mean_tpot", "p99_tpot"):
                value = value * 1000.0
            elif key == "cache_hit":
                value = value * 100.0
            elif key == "slo_attainment":
                value = "n/a" if value is None else f"{value * 100:.2f}"
            cells.append(fmt.format(value))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def _width(fmt: str) -> int:
    digits = "".join(ch for ch in fmt.split(":")[1] if ch.isdigit() or ch == ".")
    return int(digits.split(".")[0]) if digits else 8
