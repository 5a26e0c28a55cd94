"""Decode attention on the CPU over the paged KV cache (issue 26 item 2, its CPU clause): the engine's
gather + SDPA against torch's FlexAttention reading the cache in place through a paged block mask.

One decode attention call of one layer is timed: ``B`` decodes of one query token each ([B, heads,
head_dim], float32) over contexts held in the engine's head-major paged cache ([KV heads, slots,
head_dim]) in blocks of 16 tokens scattered over the pool. Each call writes the step's new K/V into
the cache first (as the engine's attention does), then attends. Variants:

``gather``
    The engine's present path: ``paged_attention`` (engine/model_runner/attention.py) with the metadata
    that ``ModelRunner._prepare`` builds for these decodes (called on a stand-in runner: the same
    ``DecodeGroup``s, grouped by ``_length_groups``).
``flex_eager``
    ``flex_attention`` over the whole cache ([1, KV, slots, D], ``enable_gqa``) with a BlockMask
    whose rows list each decode's physical blocks (full blocks as full blocks, the partly filled last
    one masked by a ``mask_mod`` that maps a physical slot to its logical position through a
    [B, pool blocks] physical-to-logical table, the scheme of torch's experimental PagedAttention).
    Eager flex_attention is torch's unfused reference: it materialises the scores over the whole cache
    for every decode (block sparsity ignored), so cases whose working set passes ``--eager-limit-gib``
    are recorded as skipped.
``flex_compiled``
    The same call under ``torch.compile(dynamic=False, fullgraph=True)``: inductor's C++ FlexAttention
    template (its flash-decoding form when the query length is 1). Compile time is recorded apart
    (``--no-compile-cache``: a cold compile; else inductor's on-disk cache may answer); only warmed
    calls are timed. A failed compile is recorded with its error. The compiled graph is specialised to
    its shapes (batch, pool size): an engine step of another batch size compiles again.

The flex variants must equal ``gather`` (``torch.allclose``, atol 1e-4) before they are timed; a wrong
result is recorded, not timed. The variants alternate within each round (gather, flex_eager,
flex_compiled, gather, ...) so that all see the same load; the median per-call time of the rounds is
reported with ``speedup`` = gather's median / the variant's (above 1: faster than the engine's path).
The per-step metadata is timed apart (``meta_us``): ``_prepare`` for gather, the BlockMask and its
physical-to-logical table for flex (built once per step, shared by the layers).

Contexts: context ``C`` gives decode ``i`` a context of ``C - 1 - (i mod 15)`` tokens (every decode has
a partly filled last block, as in serving, and all have the same block count); ``--ragged`` adds cases
whose contexts are drawn from [C/4, C] (block counts differ: the engine splits them into length groups;
flex's decoding template leaves its fast path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any, cast

import torch

BLOCK = 16
"""Tokens per KV block (the engine's default block_size)."""
VARIANTS = ("gather", "flex_eager", "flex_compiled")
ATOL = 1e-4
DEFAULT_JSON = Path("benchmarks/results/attention_cpu.json")


@dataclass(frozen=True)
class AttnShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


def model_shapes() -> dict[str, AttnShape]:
    """The two CPU models of the project: the random-weight ``llama-micro`` (modeling/random_init.py
    SHAPES) and the tiny Llama that demo/elastune_demo builds (TINY_LLAMA_SPEC)."""
    from elastune_demo.build import TINY_LLAMA_SPEC as spec
    from elastune_worker.modeling.random_init import SHAPES

    micro = SHAPES["llama-micro"]
    heads = int(micro["num_attention_heads"])
    return {
        "llama-micro": AttnShape(
            "llama-micro",
            heads,
            int(micro["num_key_value_heads"]),
            int(micro["hidden_size"]) // heads,
            int(micro["num_hidden_layers"]),
        ),
        spec.name: AttnShape(
            spec.name, spec.n_head, spec.n_kv_head or spec.n_head, spec.n_embd // spec.n_head, spec.n_layer
        ),
    }


# -- the engine's path ---------------------------------------------------------------------------------


def engine_metadata(tables: list[list[int]], lens: list[int]) -> Any:
    """The AttentionMetadata of a decode-only step, built by ``ModelRunner._prepare`` itself on a
    stand-in runner (block size, device, the gather backend) and stand-in scheduler chunks."""
    from elastune_worker.engine.model_runner.runner import ModelRunner

    runner = SimpleNamespace(block_size=BLOCK, device=torch.device("cpu"), attention_backend="gather")
    runner._decode_group = MethodType(ModelRunner._decode_group, runner)
    chunks = []
    for table, n in zip(tables, lens, strict=True):
        seq = SimpleNamespace(
            prompt_token_ids=[1] * (n - 1), output_token_ids=[2], block_table=table, all_token_ids=None
        )
        chunks.append(SimpleNamespace(seq=seq, start=n - 1, num_tokens=1, samples=True))
    _tokens, meta, _sampling = ModelRunner._prepare(
        cast(Any, runner), cast(Any, SimpleNamespace(chunks=chunks))
    )
    return meta


# -- FlexAttention over the paged cache ----------------------------------------------------------------


def flex_block_mask(tables: list[list[int]], lens: list[int], pool_blocks: int) -> Any:
    """A BlockMask over the whole cache ([1, KV, pool_blocks x BLOCK, D]): row ``b`` lists decode b's
    physical blocks, its full blocks as full (no mask evaluated) and its last, partly filled one as a
    partial block whose ``mask_mod`` maps each physical slot to its logical position (-1 blocks: not
    this decode's) and keeps those below the context length."""
    from torch.nn.attention.flex_attention import BlockMask

    b = len(tables)
    full_n = torch.empty(b, 1, 1, dtype=torch.int32)
    part_n = torch.empty(b, 1, 1, dtype=torch.int32)
    full_i = torch.zeros(b, 1, 1, pool_blocks, dtype=torch.int32)
    part_i = torch.zeros(b, 1, 1, pool_blocks, dtype=torch.int32)
    p2l = torch.full((b, pool_blocks), -1, dtype=torch.int64)
    for row, (table, n) in enumerate(zip(tables, lens, strict=True)):
        used = -(-n // BLOCK)
        full = n // BLOCK
        blocks = torch.tensor(table[:used], dtype=torch.int64)
        p2l[row, blocks] = torch.arange(used)
        full_n[row] = full
        full_i[row, 0, 0, :full] = blocks[:full].to(torch.int32)
        part_n[row] = used - full
        part_i[row, 0, 0, : used - full] = blocks[full:].to(torch.int32)
    lengths = torch.tensor(lens, dtype=torch.int64)

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical = p2l[b, kv_idx // BLOCK]
        return (logical >= 0) & (logical * BLOCK + kv_idx % BLOCK < lengths[b])

    return BlockMask.from_kv_blocks(
        part_n,
        part_i,
        full_n,
        full_i,
        BLOCK_SIZE=(1, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(1, pool_blocks * BLOCK),
        compute_q_blocks=False,
    )


def _flex(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: Any, scale: float
) -> torch.Tensor:
    """q [B, H, 1, D] over caches [1, KV, slots, D] (4-D views made outside: inductor's CPU lowering of
    flex_attention fails on a view made inside the compiled graph, "not enough values to unpack")."""
    from torch.nn.attention.flex_attention import flex_attention

    return cast(
        torch.Tensor, flex_attention(q, k_cache, v_cache, block_mask=mask, scale=scale, enable_gqa=True)
    )


def flex_paged_attention(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    mask: Any,
    scale: float,
) -> torch.Tensor:
    """What the engine's attention would do with flex: write the step's K/V at their slots (as
    ``paged_attention`` does), then attend in place. q [B, H, D] -> [B, H, D]."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))
    return attend(q.unsqueeze(2), k_cache.unsqueeze(0), v_cache.unsqueeze(0), mask, scale).squeeze(2)


# -- one case --------------------------------------------------------------------------------------------


@dataclass
class Case:
    shape: AttnShape
    batch: int
    context: int
    ragged: bool

    def lens(self) -> list[int]:
        if self.ragged:
            gen = torch.Generator().manual_seed(self.batch * 7919 + self.context)
            lo = max(2, self.context // 4)
            return torch.randint(lo, self.context + 1, (self.batch,), generator=gen).tolist()
        return [max(1, self.context - 1 - i % 15) for i in range(self.batch)]

    def pool_blocks(self) -> int:
        """The batch's blocks and 8 more (the engine bench's slack), so that the tables scatter."""
        return self.batch * -(-self.context // BLOCK) + 8

    def cache_bytes(self) -> int:
        s = self.shape
        return 2 * s.kv_heads * self.pool_blocks() * BLOCK * s.head_dim * 4

    def eager_bytes(self) -> int:
        """Eager flex's working set: K and V repeated to the query heads and expanded to the batch
        (matmul materialises them), the [B, H, 1, slots] scores and the mask's index tensors."""
        s = self.shape
        slots = self.pool_blocks() * BLOCK
        return self.batch * s.heads * slots * (2 * s.head_dim * 4 + 48)


def _tables(case: Case, gen: torch.Generator) -> list[list[int]]:
    """Each decode's block table: its blocks drawn at random over the pool (scattered), the table
    allocated a block ahead of its context as the scheduler's often is."""
    perm = torch.randperm(case.pool_blocks(), generator=gen).tolist()
    per = -(-case.context // BLOCK)
    return [perm[i * per : (i + 1) * per] for i in range(case.batch)]


def _time(fn: Callable[[], Any], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _reps(fn: Callable[[], Any], target_s: float) -> int:
    """Calls per timed sample: enough for ``target_s`` seconds, at least one."""
    t = _time(fn, 1)
    return max(1, min(1000, int(target_s / max(t, 1e-7))))


def _err(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


def run_case(
    case: Case, rounds: int, eager_limit: float, target_s: float, compile_flex: bool
) -> dict[str, Any]:
    from elastune_worker.engine.model_runner.attention import paged_attention

    s = case.shape
    gen = torch.Generator().manual_seed(case.batch * 31 + case.context)
    lens = case.lens()
    tables = _tables(case, gen)
    slots_n = case.pool_blocks() * BLOCK
    k_cache = torch.randn(s.kv_heads, slots_n, s.head_dim, generator=gen)
    v_cache = torch.randn(s.kv_heads, slots_n, s.head_dim, generator=gen)
    q = torch.randn(case.batch, s.heads, s.head_dim, generator=gen)
    k = torch.randn(case.batch, s.kv_heads, s.head_dim, generator=gen)
    v = torch.randn(case.batch, s.kv_heads, s.head_dim, generator=gen)
    scale = s.head_dim**-0.5
    res: dict[str, Any] = {
        "shape": s.name,
        "batch": case.batch,
        "context": case.context,
        "lengths": "ragged" if case.ragged else "C-15..C-1",
        "context_min": min(lens),
        "context_max": max(lens),
        "pool_blocks": case.pool_blocks(),
        "cache_mib": round(case.cache_bytes() / 2**20, 2),
        "variants": {},
    }
    meta = engine_metadata(tables, lens)
    res["length_groups"] = len(meta.decodes)
    mask = flex_block_mask(tables, lens, case.pool_blocks())
    res["meta_us"] = {
        "gather": round(
            1e6 * statistics.median(_time(lambda: engine_metadata(tables, lens), 3) for _ in range(3)), 1
        ),
        "flex": round(
            1e6
            * statistics.median(
                _time(lambda: flex_block_mask(tables, lens, case.pool_blocks()), 3) for _ in range(3)
            ),
            1,
        ),
    }
    slot_mapping = meta.slot_mapping
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "gather": lambda: paged_attention(q, k, v, k_cache, v_cache, meta, scale),
    }
    variants: dict[str, dict[str, Any]] = res["variants"]
    variants["gather"] = {}
    with torch.inference_mode():
        expected = calls["gather"]().clone()

    def check(name: str, fn: Callable[[], torch.Tensor]) -> None:
        with torch.inference_mode():
            got = fn()
        err = (got - expected).abs().max().item()
        ok = bool(torch.allclose(got, expected, atol=ATOL))
        variants[name] |= {"checked": True, "correct": ok, "max_abs_err": err}
        if ok:
            calls[name] = fn
        else:
            variants[name]["error"] = f"wrong result: max abs error {err:.3g} > atol {ATOL}"

    torch._dynamo.reset()  # each case compiles afresh (and the eager flex's own dynamo cache too)
    variants["flex_eager"] = {"checked": False, "eager_working_set_gib": round(case.eager_bytes() / 2**30, 2)}
    if case.eager_bytes() > eager_limit * 2**30:
        variants["flex_eager"]["error"] = (
            f"skipped: eager flex_attention would materialise ~{case.eager_bytes() / 2**30:.1f} GiB "
            f"(over --eager-limit-gib {eager_limit})"
        )
    else:
        try:
            check(
                "flex_eager",
                lambda: flex_paged_attention(_flex, q, k, v, k_cache, v_cache, slot_mapping, mask, scale),
            )
        except Exception as exc:  # recorded, not raised: the other variants still run
            variants["flex_eager"]["error"] = _err(exc)
    variants["flex_compiled"] = {"checked": False}
    if not compile_flex:
        variants["flex_compiled"]["error"] = "not run (--no-compile)"
    else:
        try:
            compiled = torch.compile(_flex, dynamic=False, fullgraph=True)
            t0 = time.perf_counter()
            with torch.inference_mode():
                compiled(q.unsqueeze(2), k_cache.unsqueeze(0), v_cache.unsqueeze(0), mask, scale)
            variants["flex_compiled"]["compile_s"] = round(time.perf_counter() - t0, 2)
            check(
                "flex_compiled",
                lambda: flex_paged_attention(compiled, q, k, v, k_cache, v_cache, slot_mapping, mask, scale),
            )
        except Exception as exc:
            variants["flex_compiled"]["error"] = _err(exc)
            traceback.print_exc(limit=3)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        reps = {name: _reps(fn, target_s) for name, fn in calls.items()}  # also the warm-up call
        for _ in range(rounds):
            for name in VARIANTS:
                if name in calls:
                    samples[name].append(_time(calls[name], reps[name]))
    base = statistics.median(samples["gather"])
    for name, times in samples.items():
        med = statistics.median(times)
        variants[name] |= {
            "us": round(med * 1e6, 1),
            "rounds_us": [round(t * 1e6, 1) for t in times],
            "calls_per_sample": reps[name],
            "speedup": round(base / med, 3),
        }
    return res


# -- report ----------------------------------------------------------------------------------------------


def decide(cases: list[dict[str, Any]], shapes: list[str]) -> dict[str, Any]:
    """Issue 26's bar for the CPU: a flex variant at least 1.25x faster than gather at batches 16 and 64
    for contexts of 512 and more, on both shapes (the uniform-length cases). Then, and only then, an
    engine decode step must get faster too (measured separately)."""
    needed = [
        (sh, b, c)
        for sh in shapes
        for b in (16, 64)
        for c in sorted({x["context"] for x in cases if x["context"] >= 512})
    ]
    failing: list[str] = []
    for sh, b, c in needed:
        found = [
            x
            for x in cases
            if (x["shape"], x["batch"], x["context"]) == (sh, b, c) and x["lengths"] != "ragged"
        ]
        best = max(
            (x["variants"][n].get("speedup", 0.0) for x in found for n in ("flex_eager", "flex_compiled")),
            default=None,
        )
        if best is None or best < 1.25:
            failing.append(f"{sh} b={b} ctx={c}: best flex speedup {best}")
    met = bool(needed) and not failing
    return {
        "bar": "flex (eager or compiled) >= 1.25x gather at batch 16 and 64, contexts >= 512, both shapes",
        "cases_needed": len(needed),
        "micro_bar_met": met,
        "failing": failing,
        "answer": "measure an engine decode step with flex before integrating it"
        if met
        else "not used on the CPU (the micro-benchmark bar is not met: no engine step measured)",
    }


def table(data: dict[str, Any]) -> str:
    head = (
        f"{'shape':<14}{'B':>4}{'ctx':>6}{'len':>7}{'gather us':>11}{'eager us':>11}{'x':>7}"
        f"{'compiled us':>13}{'x':>7}{'compile s':>10}{'meta g/f us':>14}"
    )
    lines = [head, "-" * len(head)]
    for c in data["cases"]:
        v = c["variants"]

        def cell(name: str, width: int, v: dict[str, Any] = v) -> tuple[str, str]:
            x = v[name]
            if "us" in x:
                return f"{x['us']:>{width}.1f}", f"{x['speedup']:>7.3f}"
            why = "skip" if str(x.get("error", "")).startswith("skipped") else "err"
            return f"{why:>{width}}", f"{'-':>7}"

        e, ex = cell("flex_eager", 11)
        k, kx = cell("flex_compiled", 13)
        comp = v["flex_compiled"].get("compile_s")
        meta = f"{c['meta_us']['gather']:.0f}/{c['meta_us']['flex']:.0f}"
        kind = "ragged" if c["lengths"] == "ragged" else "uni"
        lines.append(
            f"{c['shape']:<14}{c['batch']:>4}{c['context']:>6}{kind:>7}"
            f"{v['gather']['us']:>11.1f}{e}{ex}{k}{kx}{comp if comp is not None else '-':>10}{meta:>14}"
        )
    la, lb = data["load_avg_start"], data["load_avg_end"]
    lines.append(f"load average (1/5/15 min): start {la}, end {lb}; torch threads {data['threads']}")
    d = data["decision"]
    lines.append(f"bar: {d['bar']}: {'met' if d['micro_bar_met'] else 'not met'}")
    lines += [f"  {f}" for f in d["failing"]]
    lines.append(f"answer: {d['answer']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastune bench attention-cpu", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=None, help="model shapes (default: both CPU models)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 2048])
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds (median reported)")
    p.add_argument("--ragged", nargs="*", type=int, default=None, metavar="B",
                   help="ragged-context cases at these batches too, context 512")  # fmt: skip
    p.add_argument("--cache-limit-gib", type=float, default=2.0, help="skip cases whose cache is larger")
    p.add_argument("--eager-limit-gib", type=float, default=2.0,
                   help="skip eager flex where its materialised working set is larger")  # fmt: skip
    p.add_argument("--sample-s", type=float, default=0.05, help="seconds per timed sample (calls repeated)")
    p.add_argument("--no-compile", action="store_true", help="record flex_compiled as not run")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="inductor's caches off: compile_s is a cold compile")  # fmt: skip
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output (default {DEFAULT_JSON})")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if "OMP_WAIT_POLICY" not in os.environ:
        # The engine's processes run with PASSIVE OpenMP waits (operator cli, worker backend). OpenMP
        # reads it when torch loads, so this run goes on in a fresh interpreter that has it: spinning
        # waits on this shared 2-core machine made gather calls 44-52 ms instead of 0.15-0.25 ms.
        env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
        return subprocess.call([sys.executable, "-m", "elastune_bench.attention_cpu", *argv], env=env)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch._dynamo.config.recompile_limit = 64
    if args.no_compile_cache:
        torch._inductor.config.force_disable_caches = True
    shapes = model_shapes()
    names = args.shapes or list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        print(f"unknown shapes {unknown} (known: {', '.join(shapes)})", file=sys.stderr)
        return 2
    cases = [Case(shapes[n], b, c, False) for n in names for b in args.batches for c in args.contexts] + [
        Case(shapes[n], b, 512, True) for n in names for b in (args.ragged or [])
    ]
    data: dict[str, Any] = {
        "benchmark": "attention_cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dtype": "float32",
        "block_size": BLOCK,
        "rounds": args.rounds,
        "sample_s": args.sample_s,
        "atol": ATOL,
        "compile_cache": not args.no_compile_cache,
        "shapes": {n: vars(shapes[n]) for n in names},
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "skipped": [],
        "cases": [],
    }
    t_start = time.perf_counter()
    for case in cases:
        if case.cache_bytes() > args.cache_limit_gib * 2**30:
            data["skipped"].append(
                {"shape": case.shape.name, "batch": case.batch, "context": case.context,
                 "why": f"cache {case.cache_bytes() / 2**30:.2f} GiB > {args.cache_limit_gib} GiB"}
            )  # fmt: skip
            continue
        r = run_case(case, args.rounds, args.eager_limit_gib, args.sample_s, not args.no_compile)
        r["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        data["cases"].append(r)
        v = r["variants"]
        print(
            f"{case.shape.name} b={case.batch} ctx={case.context}{' ragged' if case.ragged else ''}: "
            + ", ".join(f"{n} {v[n].get('us', v[n].get('error', '?'))}" for n in VARIANTS),
            flush=True,
        )
    data["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    data["wall_s"] = round(time.perf_counter() - t_start, 1)
    data["decision"] = decide(data["cases"], names)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
