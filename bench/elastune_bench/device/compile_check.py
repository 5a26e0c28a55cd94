"""Every Triton kernel variant the engine launches on a GPU, compiled ahead of time for the GPU's
architecture on a machine without one (Triton lowers to PTX and assembles a cubin with the ptxas it
ships): a kernel that Triton's CPU interpreter runs but the GPU compiler refuses, or that asks for
more shared memory than a multiprocessor has, is found here instead of in a borrowed GPU's minutes.
Also runs with another Triton on the path (the GPU image's, e.g. 3.6) to find what that version lacks.

How the variants are found: a random-weight model of a shape (``--shape``: the tiny ``llama-micro``, or
``llama-3-8b-layer``, Llama-3-8B's widths and heads with one layer and a small vocabulary) serves in
bfloat16 on the CPU through every Triton path (attention, fused element-wise ops, LoRA with ranks 8 and
64 through both kernels) in the interpreter, and each launch's arguments are recorded: start-up's
``compile_kernels`` and LoRA compile, then a short mixed batch. The interpreter's bf16 arithmetic is not
a GPU's (the start-up checks would refuse it, so they are skipped here), which does not matter: only
the launches' types and constexprs are kept. Each distinct variant is then compiled for ``--arch``
(default sm_90: H100/H200) with the constexprs the GPU would use: ``UPCAST`` off (an interpreter
workaround) and a decode tile at every flash-decoding split count (the CPU's 4 stand-in
multiprocessors reach fewer than a GPU's 132), each argument specialized by Triton's own launcher code
(an integer 1 as a constant, divisibility-by-16 hints for integers and aligned pointers). Not covered:
what only running a kernel shows (values, registers spilled, time: the GPU run's parts).

``python -m elastune_bench.device.compile_check [--shape S] [--arch 90] [--json OUT]``; exit 1 when a
variant fails to compile or exceeds the shared-memory limit."""

from __future__ import annotations

import os
import sys

# Before anything imports Triton: the recording runs the kernels on the CPU, in the interpreter; the
# child that compiles them (--compile) needs Triton's real JIT functions.
if "--compile" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SHARED_LIMIT = {90: 232_448, 80: 166_912, 89: 101_376}
"""Shared memory a block may use, bytes (the opt-in maximum per block): H100/H200, A100, L4/L40."""
SPLIT_COUNTS = (1, 2, 4, 8, 16)
"""Flash-decoding's split counts (triton_attention.MAX_SPLITS = 16, powers of 2)."""
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-micro": ("llama-micro", {}),
    "llama-3-8b-layer": ("llama-3-8b", {"num_hidden_layers": 1, "vocab_size": 512}),
}
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
          torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}  # fmt: skip


@dataclass
class Recorder:
    """Each distinct launch: the kernel (module, name), every argument by name (a tensor as its dtype
    and whether it is 16-byte aligned), the launch options."""

    launches: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, kernel: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        values = dict(zip(kernel.arg_names, args, strict=False))
        values |= {k: v for k, v in kwargs.items() if k not in options}
        launch = {"module": kernel.fn.__module__, "name": kernel.fn.__name__, "options": options,
                  "values": {k: _encode(v) for k, v in values.items()}}  # fmt: skip
        self.launches.setdefault(json.dumps(launch, sort_keys=True), launch)


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # its dtype, and whether Triton would call it 16-byte aligned
        return {"tensor": DTYPES[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    return value


def _example(value: dict[str, Any]) -> torch.Tensor:
    """A tensor of the recorded dtype and alignment, for Triton's own specialization to look at."""
    dtype = next(d for d, name in DTYPES.items() if name == value["tensor"])
    t = torch.empty(64, dtype=dtype)
    return t if value["aligned"] else t[1:]


Compile = tuple[Any, dict[str, str], dict[str, Any], dict[tuple[int, ...], Any], dict[str, int]]


def gpu_variants(launch: dict[str, Any]) -> list[Compile]:
    """(kernel, signature, constexprs, attributes, options) a GPU compiles for a recorded launch, as
    Triton's launcher specializes it (an integer 1 becomes a constant; integers and aligned pointers
    divisible by 16 get the divisibility hint, unless the kernel says not to), with UPCAST off (an
    interpreter workaround) and a decode tile at every split count. Imports the compiled kernels: call
    it where TRITON_INTERPRET is unset."""
    import importlib

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
    values = launch["values"]
    signature: dict[str, str] = {}
    consts: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, p in enumerate(kernel.params):
        value = values.get(p.name, p.default)
        if p.is_constexpr:
            signature[p.name], consts[p.name] = "constexpr", value
            continue
        arg = _example(value) if isinstance(value, dict) else value
        kind, spec = native_specialize_impl(
            BaseBackend, arg, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
        )[:2]
        signature[p.name] = kind
        if kind == "constexpr":
            consts[p.name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    if "UPCAST" in consts:
        consts["UPCAST"] = False
    splits = SPLIT_COUNTS if "SPLITS" in consts and consts.get("TILE_Q", 1) == 1 else (consts.get("SPLITS"),)
    out: list[Compile] = []
    for s in splits:
        c = consts | ({"SPLITS": s} if "SPLITS" in consts else {})
        out.append((kernel, signature, c, attrs, launch["options"]))
    return out


def record(shape: str, workdir: Path) -> Recorder:
    """Serve a short mixed batch on the CPU through every Triton path, recording each launch."""
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.core.sampling import SamplingParams
    from elastune_worker.engine.llm_engine import LLMEngine
    from elastune_worker.engine.model_runner import fused_kernels, fused_ops, runner, triton_attention
    from elastune_worker.engine.model_runner import triton_paged_kernel as paged
    from elastune_worker.engine.model_runner.lora import sgmv, sgmv_kernels
    from elastune_worker.modeling.random_init import (
        NoTokenizer,
        shape_config,
        write_random_lora,
        write_random_model,
    )

    rec = Recorder()
    # The patches below stay for the rest of this process: it exists for the recording (see main).

    class Recorded:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                rec.add(self.kernel, args, kwargs)
                return self.kernel[grid](*args, **kwargs)

            return launch

    attention, merge = paged.paged_attention_kernel, paged.merge_splits_kernel
    triton_attention._kernel = lambda device_type: Recorded(attention)  # type: ignore[assignment]
    triton_attention._merge_kernel = lambda device_type: Recorded(merge)  # type: ignore[assignment]
    for name in ("add_rms_norm_kernel", "rope_kernel", "silu_mul_kernel"):
        setattr(fused_kernels, name, Recorded(getattr(fused_kernels, name)))
    for name in ("lora_shrink_kernel", "lora_expand_kernel"):
        setattr(sgmv_kernels, name, Recorded(getattr(sgmv_kernels, name)))
    # An H100's multiprocessors, so that decodes split their contexts (and merge the splits) as there.
    triton_attention.CPU_PROGRAM_SLOTS = 132  # type: ignore[misc]
    # The interpreter's bf16 arithmetic is not a GPU's: the start-up checks would refuse every kernel.
    for module in (runner, fused_ops, sgmv):
        module.triton_problem = lambda *a, **k: None  # type: ignore[attr-defined]

    base, overrides = SHAPES[shape]
    cfg = shape_config(base) | overrides
    model = write_random_model(workdir / "model", cfg)
    adapters = {r: write_random_lora(workdir / f"r{r}", cfg, r) for r in (8, 64)}
    for kernel in ("padded", "unpadded"):
        eng = LLMEngine(
            model,
            EngineConfig(
                device="cpu", dtype="bfloat16", kv_cache_tokens=2048, max_model_len=256, max_num_seqs=4,  # type: ignore[arg-type]
                max_num_batched_tokens=64, cuda_graphs=False, attention_backend="triton",
                elementwise_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=64,
                lora_kernel=kernel, lora_backend="triton",  # type: ignore[arg-type]
            ),
            tokenizer=NoTokenizer(),
        )  # fmt: skip
        eng.runner.compile_kernels()  # on CUDA the runner does this at start-up
        eng.runner.compile_lora_or_fall_back()
        for r, path in adapters.items():
            eng.load_lora(f"r{r}", str(path))
        names: list[str | None] = ["r8", "r64", None]
        prompts = [[3 + i] * n for i, n in enumerate((40, 9, 17))]
        eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), names)
    return rec


def compile_all(launches: list[dict[str, Any]], arch: int) -> list[dict[str, Any]]:
    """Compile each launch's GPU variants for sm_``arch``; one row each. Run without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    limit = SHARED_LIMIT.get(arch)
    variants = {}
    for launch in launches:
        for kernel, signature, consts, attrs, options in gpu_variants(launch):
            hints = sorted(str(k) for k in attrs)
            key = json.dumps(
                [launch["module"], launch["name"], signature, consts, hints, options], sort_keys=True
            )
            variants.setdefault(key, (kernel, signature, consts, attrs, options))
    rows = []
    for key in sorted(variants):
        kernel, signature, consts, attrs, options = variants[key]
        row: dict[str, Any] = {"kernel": kernel.fn.__name__,
                               "constexprs": {k: c for k, c in consts.items() if c is not None},
                               "divisible_by_16": [kernel.params[k[0]].name for k in attrs],
                               "options": options}  # fmt: skip
        t0 = time.perf_counter()
        try:
            src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            shared = int(compiled.metadata.shared)
            row |= {"ok": limit is None or shared <= limit, "shared_bytes": shared,
                    "num_warps": compiled.metadata.num_warps}  # fmt: skip
            if not row["ok"]:
                row["error"] = f"{shared} bytes of shared memory, the limit on sm_{arch} is {limit}"
        except Exception as exc:  # any compile failure is the finding
            row |= {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-micro")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--save-launches", type=Path, help="also write the recorded launches here")
    p.add_argument(
        "--launches",
        type=Path,
        help="compile these saved launches instead of recording (e.g. "
        "with another Triton first on PYTHONPATH, whose interpreter may not run the kernels)",
    )
    p.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # the child: compile these launches
    args = p.parse_args(argv)
    if args.compile:
        rows = compile_all(json.loads(args.compile.read_text()), args.arch)
        args.compile.with_suffix(".out.json").write_text(json.dumps(rows))
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.launches:
            launches = json.loads(args.launches.read_text())
        else:
            launches = list(record(args.shape, Path(tmp)).launches.values())
        if args.save_launches:
            args.save_launches.write_text(json.dumps(launches))
        recorded_s = time.perf_counter() - t0
        # Compiling needs Triton's real JIT functions: a process of its own, without the interpreter.
        todo = Path(tmp) / "launches.json"
        todo.write_text(json.dumps(launches))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        cmd = [sys.executable, "-m", "elastune_bench.device.compile_check", "--arch", str(args.arch),
               "--compile", str(todo)]  # fmt: skip
        subprocess.run(cmd, env=env, check=True)
        rows = json.loads(todo.with_suffix(".out.json").read_text())
    import triton

    failed = [r for r in rows if not r["ok"]]
    shape = f"launches from {args.launches}" if args.launches else args.shape
    result = {"triton": triton.__version__, "torch": torch.__version__, "shape": shape,
              "arch": args.arch, "variants": len(rows), "failed": len(failed), "launches": len(launches),
              "record_seconds": round(recorded_s, 1),
              "compile_seconds": round(sum(r["seconds"] for r in rows), 1), "results": rows}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"Triton {triton.__version__}, sm_{args.arch}, {shape}: {len(rows)} kernel variants, "
          f"{len(failed)} failed (recorded in {recorded_s:.0f} s, "
          f"compiled in {result['compile_seconds']} s)")  # fmt: skip
    for r in rows:
        mark = "ok  " if r["ok"] else "FAIL"
        consts = ", ".join(f"{k}={c}" for k, c in r["constexprs"].items())
        shared = f"{r.get('shared_bytes', '-')} B shared"
        print(f"  {mark} {r['kernel']} [{consts}] {shared}" + (f": {r['error']}" if not r["ok"] else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
