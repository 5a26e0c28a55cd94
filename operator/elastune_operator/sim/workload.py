"""Workloads for the simulator, built the way the paper builds its traces (§6.1).

Per LLM, a number of jobs over a 20-minute trace; arrivals are Poisson within minute buckets (the
trace has minute granularity; within a minute requests are invoked with exponential inter-arrival
times — conditioned on the minute's count, that is uniform order statistics). Minute weights are
gamma-distributed so traffic is bursty like the paper's trace (max requests per minute ≈ 5× the mean).
Each job has a trace duration on a trace GPU count; its SLO is duration × S + allocation overhead.
Arrivals can instead be replayed from a CSV of timestamps.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..scheduling.estimator import LLMProfile, model_iteration_seconds


@dataclass(slots=True)
class SimLLM:
    """An LLM as the simulator's physics sees it, plus the profile the scheduler starts from."""

    profile: LLMProfile
    true_iteration_factor: float = 1.1
    """Reality / configured profile: the estimator has to learn the 10 % it was told wrong."""
    true_cold_start_seconds: float | None = None
    """Mean real warm-up of one GPU; None = the configured T_cold."""

    @property
    def name(self) -> str:
        return self.profile.name

    def true_iteration_seconds(self, gpus: int) -> float:
        return model_iteration_seconds(self.profile, gpus) * self.true_iteration_factor

    @property
    def cold_start_mean(self) -> float:
        t = self.true_cold_start_seconds
        return self.profile.cold_start_seconds if t is None else t


def paper_llms() -> dict[str, SimLLM]:
    """The paper's three LLMs. T_cold: allocation overhead is 37–41 % of an LPT job's execution and
    close to a minute for LLMs (§1, §2.2); bank lookup latencies are the paper's K=50 figures (§6.3)."""
    return {
        m.name: m
        for m in (
            SimLLM(LLMProfile("gpt2-base", 0.12, 20.0, bank_lookup_seconds=5.3)),
            SimLLM(LLMProfile("gpt2-large", 0.30, 30.0, bank_lookup_seconds=6.1)),
            SimLLM(LLMProfile("vicuna-7b", 0.80, 50.0, bank_lookup_seconds=9.2)),
        )
    }


LOADS: dict[str, dict[str, int]] = {
    # Jobs per LLM in a 20-minute trace (paper §6.1: GPT2-B / GPT2-L / V7B).
    "low": {"gpt2-base": 41, "gpt2-large": 55, "vicuna-7b": 42},
    "medium": {"gpt2-base": 77, "gpt2-large": 71, "vicuna-7b": 65},
    "high": {"gpt2-base": 99, "gpt2-large": 85, "vicuna-7b": 76},
}


@dataclass(slots=True)
class SimJob:
    id: str
    llm: str
    arrival: float
    slo: float
    max_iterations: int
    iterations: int
    """Iterations to the target with the job's own initial prompt."""
    bank_speedup: float
    """Iterations saved when it starts from the Prompt Bank's pick: iterations / speedup."""
    trace_gpus: int
    trace_duration: float
    bank_mode: str = "auto"


@dataclass(slots=True)
class WorkloadConfig:
    llms: dict[str, SimLLM] = field(default_factory=paper_llms)
    jobs_per_llm: dict[str, int] = field(default_factory=lambda: dict(LOADS["medium"]))
    slo_emergence: float = 1.0
    """S: SLO = trace duration × S + allocation overhead (paper §6.1)."""
    minutes: int = 20
    duration_median_seconds: float = 30.0
    duration_sigma: float = 1.0
    duration_bounds: tuple[float, float] = (5.0, 600.0)
    """'Job durations vary from a few seconds to several minutes' (paper §6.1)."""
    gpu_choices: tuple[int, ...] = (1, 2, 4, 8)
    gpu_weights: tuple[float, ...] = (0.45, 0.25, 0.2, 0.1)
    burstiness: float = 0.7
    """Gamma shape of per-minute weights; lower is burstier."""
    bank_speedup: tuple[float, float, float, float] = (1.8, 0.35, 1.0, 4.5)
    """Lognormal (median, sigma) clipped to [lo, hi]: the bank's pick vs the user's own prompt; the
    paper measures median/max ITA 1.7–4.5× the best prompt's (§2.2) and picks ≥ 90 % of the best."""
    arrivals_csv: Path | None = None
    stretch_replay: bool = True
    """Rescale a replayed window to span ``minutes`` (keeping its burst shape): inference traces such
    as Azure's hold thousands of requests per hour, far denser than prompt-tuning jobs."""
    seed: int = 0


def _minute_arrivals(rng: np.random.Generator, count: int, minutes: int, burstiness: float) -> np.ndarray:
    weights = rng.gamma(burstiness, 1.0, size=minutes)
    weights /= weights.sum()
    per_minute = rng.multinomial(count, weights)
    times = [60.0 * m + np.sort(rng.uniform(0.0, 60.0, size=n)) for m, n in enumerate(per_minute)]
    return np.concatenate(times) if times else np.array([])


def read_arrivals_csv(path: Path, column: str | None = None) -> np.ndarray:
    """Arrival times in seconds from a CSV: the first column (or ``column``) holding numbers or
    timestamps (ISO 8601); shifted so the first arrival is at 0."""
    from datetime import datetime

    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    col = column or next(iter(rows[0]))
    if col not in rows[0]:
        raise ValueError(f"{path}: no column {col!r}; columns: {list(rows[0])}")
    out: list[float] = []
    for i, row in enumerate(rows, start=2):
        raw = (row.get(col) or "").strip()
        try:
            value = float(raw)
        except ValueError:
            try:
                value = datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
            except ValueError:
                raise ValueError(f"{path}:{i}: {col}={raw!r} is neither seconds nor a timestamp") from None
        if not math.isfinite(value):
            raise ValueError(f"{path}:{i}: {col}={raw!r} is not a finite time")
        out.append(value)
    arr = np.sort(np.asarray(out))
    return arr - arr[0]


def generate(cfg: WorkloadConfig) -> list[SimJob]:
    """A seeded, reproducible job list, sorted by arrival."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi = cfg.duration_bounds
    weights = np.asarray(cfg.gpu_weights) / sum(cfg.gpu_weights)
    med, sig, s_lo, s_hi = cfg.bank_speedup
    replay = read_arrivals_csv(cfg.arrivals_csv) if cfg.arrivals_csv else None
    jobs: list[SimJob] = []
    for llm_name, count in cfg.jobs_per_llm.items():
        llm = cfg.llms[llm_name]
        if replay is not None:
            if len(replay) < count:
                raise ValueError(
                    f"{cfg.arrivals_csv}: {len(replay)} arrivals, but {count} jobs of {llm_name} requested"
                )
            start = int(rng.integers(0, len(replay) - count + 1))
            arrivals = replay[start : start + count] - replay[start]
            if cfg.stretch_replay and len(arrivals) > 1 and arrivals[-1] > 0:
                arrivals = arrivals * (cfg.minutes * 60.0 / arrivals[-1])
        else:
            arrivals = _minute_arrivals(rng, count, cfg.minutes, cfg.burstiness)
        for i, t in enumerate(arrivals):
            g = int(rng.choice(cfg.gpu_choices, p=weights))
            d = float(
                np.clip(rng.lognormal(math.log(cfg.duration_median_seconds), cfg.duration_sigma), lo, hi)
            )
            iters = max(1, math.ceil(d / llm.true_iteration_seconds(g)))
            speedup = float(np.clip(rng.lognormal(math.log(med), sig), s_lo, s_hi))
            jobs.append(
                SimJob(
                    id=f"{llm_name}-{i:04d}",
                    llm=llm_name,
                    arrival=float(t),
                    slo=d * cfg.slo_emergence + llm.profile.cold_start_seconds,
                    max_iterations=iters,
                    iterations=iters,
                    bank_speedup=speedup,
                    trace_gpus=g,
                    trace_duration=d,
                )
            )
    jobs.sort(key=lambda j: (j.arrival, j.id))
    return jobs
