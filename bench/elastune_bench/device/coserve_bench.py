"""Part c2: ``elastune bench coserve`` on the device: co-serving's finetuning throughput against
temporal sharing at their SLO attainment (FlexLLM's claim is 1.9-4.8x on GPUs), on a random-weight
Llama-3-8B in bf16 (``--shape llama-3-8b``: the tiny Llama is launch-bound on a GPU, where the
co-served job's per-window fixed cost exceeded the whole TPOT SLO) and on ``llama-micro`` in the CPU
smoke run; its JSON as coserve.json. The ShareGPT trace is ``bench coserve``'s own default: the
repository's ``data/sharegpt_250.json.gz`` (the working tree carries it to the device machine), or the
copy ``$ELASTUNE_DATASET`` names.

Sized for ~50 s on an H100/H200 (run.py's time box: 75 s): set-up ~15 s (the engine, graphs, the
profile, the trainer's base), then per mode a light load of 24 requests at 8/s (3 s) and a heavy load
of 200 at 48/s (4.2 s; the goal's load, long enough for tens of 8B finetuning steps), outputs of at
most 32 tokens; inference_only last (the SLO attainment the pod reaches without a job: whether the
heavy load is within its capacity, as FlexLLM's comparison needs; the first 8B run read 1-51 % for
every mode). GPU memory: the engine's 15 GiB of weights + 4 GiB of KV (2,048 blocks) + the trainer's
own 15 GiB copy + working sets: ~40 GiB of an 80 GiB H100."""

from __future__ import annotations

from elastune_bench.device.common import part_args

FULL_ARGS = ("--device", "cuda", "--shape", "llama-3-8b", "--requests", "200", "--light-requests", "24",
             "--light-rate", "8", "--heavy-rate", "48",
             "--modes", "coserve,temporal_16,temporal_64,inference_only")  # fmt: skip
SMOKE_ARGS = ("--device", "cpu", "--shape", "llama-micro", "--requests", "6", "--max-output", "4",
              "--light-rate", "40", "--heavy-rate", "80",
              "--modes", "coserve,temporal_16,inference_only")  # fmt: skip


def bench_argv(out: str, smoke: bool) -> list[str]:
    return ["--quick", "--json", out, *(SMOKE_ARGS if smoke else FULL_ARGS)]


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    from elastune_bench.serving import coserve

    return coserve.main(bench_argv(str(args.out / "coserve.json"), args.smoke))


if __name__ == "__main__":
    raise SystemExit(main())
