"""The device check's driver: every part in its own interpreter under its own time box and one overall
deadline, its output in OUTDIR/logs/<part>.log, its status in OUTDIR/run.json, the table last."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastune_bench.device import table

PARTS: tuple[tuple[str, int], ...] = (
    ("correctness", 75),
    ("ceilings", 25),
    ("engine", 120),
    ("hf_generate", 75),
    ("lora_bench", 85),
    ("coserve_bench", 75),
)
"""(module, seconds on the GPU): 455 s in all, inside the 8-minute run with the installs before. The
two benchmarks run the random-weight Llama-3-8B (issue 26 item 4c); each writes its JSON after every
mode, so a part its time box ends keeps the modes it finished. Seen on an H200 (2026-11-27, every part
in one run): correctness 46 s, ceilings 5, engine 39, hf_generate 27, coserve_bench 71, and lora_bench
cut at 55 s after three of its four modes (hence 85 s, from the engine's box)."""
EXTRA_PARTS: tuple[tuple[str, int], ...] = (
    ("profile_lora", 120),
    ("profile_attention", 90),
    ("gpu_tests", 120),
)
"""Run only when named in ``--parts`` (the default run stays inside its 8 minutes): where a LoRA decode
step's time goes, under torch.profiler; the decode attention kernel over its launch settings; the
engine's GPU test files under pytest (their CUDA-only cases)."""
SMOKE_SECONDS = 60
"""A smoke part's time box (each takes 5-30 s on a loaded 2-core CPU)."""


PREPARE = """
from elastune_demo import adapters as A, build as B
for spec in (B.DEFAULT_SPEC, B.TINY_LLAMA_SPEC):
    B.ensure_tiny_model(spec=spec)
for rank in (8, 16, 32, 64):
    A.ensure_tiny_adapter(rank)
"""
"""What the parts read from the model cache (the tiny GPT-2 and Llama, the Llama's adapters): built before
any part's clock starts. tools/device_wheels.sh carries them to the GPU machine, where this finds them at
once; on a fresh machine's --smoke run it builds them (about two minutes, once) instead of every part
timing out while building them inside its box."""


def prepare(out: Path) -> dict[str, object]:
    t0 = time.perf_counter()
    log = out / "logs" / "prepare.log"
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-c", PREPARE], stdout=f, stderr=subprocess.STDOUT).returncode
    status = {"module": "prepare", "seconds": round(time.perf_counter() - t0, 1),
              "status": "ok" if rc == 0 else f"exit {rc}"}  # fmt: skip
    print(f"[prepare] the tiny models and adapters in the cache: {status['status']} in {status['seconds']} s",
          flush=True)  # fmt: skip
    return status


def run_part(module: str, out: Path, smoke: bool, seconds: float) -> dict[str, object]:
    log = out / "logs" / f"{module}.log"
    cmd = [sys.executable, "-m", f"elastune_bench.device.{module}", str(out)]
    cmd += ["--smoke"] if smoke else []
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the part and any child it started
            proc.wait()
            rc = None
    status = {"module": module, "seconds": round(time.perf_counter() - t0, 1), "time_box_s": round(seconds)}
    status |= {"status": "timed out"} if rc is None else {"status": "ok" if rc == 0 else f"exit {rc}"}
    tail = log.read_text(errors="replace").splitlines()[-3:]
    why = "" if rc == 0 else ": " + " | ".join(tail)
    print(f"[{module}] {status['status']} in {status['seconds']} s{why}",
          flush=True)  # fmt: skip
    return status


def chosen_parts(parts: str | None) -> set[str]:
    """The parts ``--parts`` names: none, the default run; "all", every part (the extra ones run last,
    while the deadline leaves time); else a comma-separated list. ValueError naming unknown ones."""
    known = {m for m, _ in PARTS + EXTRA_PARTS}
    if parts == "all":
        return known
    chosen = set(parts.split(",")) if parts else {m for m, _ in PARTS}
    if chosen - known:
        raise ValueError(f"unknown parts {sorted(chosen - known)}; known: {', '.join(sorted(known))}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--smoke", action="store_true", help="every part on this machine's CPU, tiny shapes")
    p.add_argument("--deadline", type=float, help="seconds for all parts (default 455; --smoke 170)")
    p.add_argument("--parts", help="comma-separated parts (default: all but the extra profile_* ones; "
                   "'all': every part, the extra ones last, under --deadline)")  # fmt: skip
    args = p.parse_args(argv)
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        chosen = chosen_parts(args.parts)
    except ValueError as exc:
        p.error(str(exc))
    prepared = prepare(args.out)  # before the deadline's clock: a build is no part's time
    deadline = time.perf_counter() + (args.deadline or (170 if args.smoke else sum(s for _, s in PARTS)))
    statuses: list[dict[str, object]] = []
    if prepared["status"] != "ok":  # the parts then build what they miss themselves, inside their boxes
        statuses.append(prepared)
    for module, seconds in PARTS + EXTRA_PARTS:
        if module not in chosen:
            continue
        left = deadline - time.perf_counter()
        if left < 10:
            statuses.append({"module": module, "status": "skipped: the run's deadline came"})
            continue
        box = min(SMOKE_SECONDS if args.smoke else seconds, left)
        statuses.append(run_part(module, args.out, args.smoke, box))
        (args.out / "run.json").write_text(
            json.dumps({"smoke": args.smoke, "parts": statuses}, indent=2) + "\n"
        )
    text = table.render(args.out)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0 if all(s["status"] == "ok" for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
