"""Workloads for the routing simulator: requests with token ids, adapters, SLOs and arrival times.

- ``prefix_workload`` — Preble-style prompt sharing (§3: tool use, long documents): a short system
  prompt shared by every request, then one of many long shared documents or tool instructions chosen
  with Zipf popularity (ToolBench's Zipf-1.1 in Preble §5.4), then a per-request question; short outputs.
- ``multiturn_workload`` — conversations built from ShareGPT prompt/response pairs
  (``data/sharegpt_250.json.gz``): each turn's prompt is the conversation so far (earlier prompts and
  answers) plus the new question; a turn arrives a think time after the previous answer finished.
- ``lora_workload`` — CaraServe-style multi-LoRA traffic (§7.5): many adapters of mixed ranks
  {8, 16, 32, 64}, skewed (Zipf) popularity, a TPOT SLO per request; no prompt sharing.

Arrivals are Poisson (``poisson_arrivals``) or the real times of ``data/azure_llm_conv_2023.csv.gz``
(``azure_trace``: TIMESTAMP, ContextTokens, GeneratedTokens), optionally compressed by a time scale.
Token ids are synthetic and seeded: only equality matters to prefix caches and radix trees. A request
keeps its prompt as shared parts (a document is one tuple shared by every request using it) and
materialises the tokens at arrival, so a large run does not hold every prompt at once.
"""

from __future__ import annotations

import csv
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from elastune_common import datasets

VOCAB = 32_000
RANKS = (8, 16, 32, 64)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request of a workload, and what happened to it in the simulator."""

    id: str
    arrival: float
    parts: tuple[tuple[int, ...], ...]
    """The prompt as concatenated parts (shared tuples); see ``tokens``."""
    output_tokens: int
    adapter: str | None = None
    rank: int = 0
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    output_ids: tuple[int, ...] = ()
    """The answer's token ids when a later turn of the conversation includes them (multi-turn)."""
    next_turn: SimRequest | None = None
    """The next turn of the conversation: it arrives ``think_time`` after this one finished."""
    think_time: float = 0.0
    # -- filled by the simulator -------------------------------------------------------------------------
    endpoint: str | None = None
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0
    """Prompt tokens found in the endpoint's prefix cache at admission."""
    service_floor: float = 0.0
    """A lower bound of its latency on an idle endpoint (conservation checks)."""
    _tokens: tuple[int, ...] | None = field(default=None, repr=False)

    @property
    def prompt_len(self) -> int:
        return sum(len(p) for p in self.parts)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt's token ids (built on first use, dropped by ``release_tokens``)."""
        if self._tokens is None:
            self._tokens = self.parts[0] if len(self.parts) == 1 else tuple(t for p in self.parts for t in p)
        return self._tokens

    def release_tokens(self) -> None:
        self._tokens = None

    @property
    def latency(self) -> float:
        assert self.finished is not None
        return self.finished - self.arrival

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for a one-token answer)."""
        if self.output_tokens <= 1 or self.finished is None or self.first_token is None:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    def met_slo(self) -> bool | None:
        """Whether it met its SLOs (None: it had none)."""
        if self.ttft_slo is None and self.tpot_slo is None:
            return None
        ok = self.ttft_slo is None or self.ttft <= self.ttft_slo
        tpot = self.tpot
        return ok and (self.tpot_slo is None or tpot is None or tpot <= self.tpot_slo)


def _random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of items 1 … n under Zipf's law with exponent ``s`` (normalised)."""
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


# -- arrivals ---------------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int = 0, start: float = 0.0) -> list[float]:
    """``n`` arrival times of a Poisson process with ``rate`` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t, times = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival: float
    context_tokens: int
    generated_tokens: int


def azure_trace(
    path: str | Path | None = None, limit: int | None = None, time_scale: float = 1.0
) -> list[TraceRow]:
    """Rows of the Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens; the shipped
    copy unless ``path``), with arrival times in seconds from the first row, multiplied by
    ``time_scale`` (< 1 compresses: Preble ran the trace at 0.7)."""
    rows: list[TraceRow] = []
    start: datetime | None = None
    with datasets.open_text(path or datasets.azure_trace_path()) as f:
        for record in csv.DictReader(f):
            stamp = record["TIMESTAMP"].strip()
            # Seven fractional digits (100 ns): datetime takes at most six.
            if "." in stamp:
                head, frac = stamp.split(".", 1)
                stamp = f"{head}.{frac[:6]}"
            t = datetime.fromisoformat(stamp)
            if start is None:
                start = t
            rows.append(
                TraceRow(
                    (t - start).total_seconds() * time_scale,
                    int(record["ContextTokens"]),
                    int(record["GeneratedTokens"]),
                )
            )
            if limit is not None and len(rows) >= limit:
                break
    return rows


# -- Preble-style prefix sharing --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PrefixWorkload:
    requests: int = 2000
    documents: int = 64
    """Shared long prompts (tools, documents, videos): the key portions."""
    document_tokens: tuple[int, int] = (1500, 4000)
    system_tokens: int = 200
    """A system prompt shared by every request (the root of every tree)."""
    question_tokens: tuple[int, int] = (20, 200)
    output_tokens: tuple[int, int] = (8, 64)
    zipf: float = 1.1
    seed: int = 0


def prefix_workload(w: PrefixWorkload, arrivals: Sequence[float]) -> list[SimRequest]:
    """``w.requests`` requests (or as many as ``arrivals``) sharing ``w.documents`` long prefixes."""
    rng = random.Random(w.seed)
    system = _random_tokens(rng, w.system_tokens)
    docs = [_random_tokens(rng, rng.randint(*w.document_tokens)) for _ in range(w.documents)]
    weights = zipf_weights(w.documents, w.zipf)
    order = list(range(w.documents))
    rng.shuffle(order)  # popularity independent of length
    out = []
    for i, t in enumerate(arrivals[: w.requests]):
        doc = docs[order[rng.choices(range(w.documents), weights)[0]]]
        question = _random_tokens(rng, rng.randint(*w.question_tokens))
        out.append(SimRequest(f"p{i}", t, (system, doc, question), rng.randint(*w.output_tokens)))
    return out


# -- multi-turn (ShareGPT) --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    conversations: int = 200
    min_turns: int = 1
    max_turns: int = 5
    think_time: float = 5.0
    """Mean seconds between an answer and the next question (exponential)."""
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 512
    system_tokens: int = 0
    seed: int = 0


def load_sharegpt(path: str | Path | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) of each entry of a ShareGPT file like the shipped
    ``data/sharegpt_250.json.gz`` (the default; {"entries": [{"prompt_length", "response_length", …}]})."""
    data = datasets.read_json(path or datasets.sharegpt_path())
    entries = data["entries"] if isinstance(data, dict) else data
    return [(int(e["prompt_length"]), int(e["response_length"])) for e in entries]


def multiturn_workload(
    w: MultiTurnWorkload, pairs: Sequence[tuple[int, int]], starts: Sequence[float]
) -> list[SimRequest]:
    """Conversations of ``min_turns`` … ``max_turns`` turns, each turn one (prompt, response) pair
    drawn in order from ``pairs`` (cycled); conversation i starts at ``starts[i]``. Returns first turns
    only: later turns hang off ``next_turn`` and arrive when the simulator finishes the previous one."""
    if not pairs:
        raise ValueError("no ShareGPT pairs")
    rng = random.Random(w.seed)
    system = _random_tokens(rng, w.system_tokens)
    cursor: Iterator[tuple[int, int]] = iter(())
    firsts = []

    def next_pair() -> tuple[int, int]:
        nonlocal cursor
        try:
            return next(cursor)
        except StopIteration:
            cursor = iter(pairs)
            return next(cursor)

    for c, start in enumerate(starts[: w.conversations]):
        history: tuple[tuple[int, ...], ...] = (system,) if system else ()
        previous: SimRequest | None = None
        for turn in range(rng.randint(w.min_turns, w.max_turns)):
            p, r = next_pair()
            question = _random_tokens(rng, max(1, min(p, w.max_prompt_tokens)))
            answer = _random_tokens(rng, max(1, min(r, w.max_output_tokens)))
            parts = (*history, question)
            req = SimRequest(
                f"c{c}t{turn}",
                start if previous is None else float("nan"),
                parts,
                len(answer),
                output_ids=answer,
                think_time=rng.expovariate(1.0 / w.think_time) if w.think_time > 0 else 0.0,
            )
            if previous is None:
                firsts.append(req)
            else:
                previous.next_turn = req
            previous = req
            history = (*parts, answer)
    return firsts


# -- CaraServe-style multi-LoRA ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoraWorkload:
    requests: int = 6000
    adapters: int = 1000
    ranks: tuple[int, ...] = RANKS
    zipf: float = 1.0
    prompt_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (16, 256)
    tpot_slo: float | None = 0.05
    ttft_slo: float | None = None
    seed: int = 0


def lora_workload(
    w: LoraWorkload, arrivals: Sequence[float], lengths: Sequence[tuple[int, int]] | None = None
) -> list[SimRequest]:
    """Requests for ``w.adapters`` adapters of mixed ranks with Zipf popularity. ``lengths`` (prompt,
    output) pairs, e.g. from the Azure trace, replace the uniform ranges when given."""
    rng = random.Random(w.seed)
    ranks = [w.ranks[i % len(w.ranks)] for i in range(w.adapters)]
    rng.shuffle(ranks)  # popularity independent of rank
    weights = zipf_weights(w.adapters, w.zipf)
    out = []
    for i, t in enumerate(arrivals[: w.requests]):
        a = rng.choices(range(w.adapters), weights)[0]
        if lengths:
            p, o = lengths[i % len(lengths)]
        else:
            p, o = rng.randint(*w.prompt_tokens), rng.randint(*w.output_tokens)
        out.append(
            SimRequest(
                f"l{i}",
                t,
                (_random_tokens(rng, max(1, p)),),
                max(1, o),
                adapter=f"lora-{a}",
                rank=ranks[a],
                ttft_slo=w.ttft_slo,
                tpot_slo=w.tpot_slo,
            )
        )
    return out


def adapter_ranks(requests: Sequence[SimRequest]) -> dict[str, int]:
    return {r.adapter: r.rank for r in requests if r.adapter is not None}
