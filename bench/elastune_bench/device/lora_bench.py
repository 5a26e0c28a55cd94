"""Part c1: ``elastune bench lora`` on the device: CaraServe's cold-start modes with real host-to-device
adapter copies (nothing emulated on CUDA) and the padded and unpadded kernels, on a random-weight
Llama-3-8B in bf16 with random adapters of its shape (ranks 8/16/32/64 on q, k, v, fp16: rank 64 is
72 MiB, a real adapter's copy) and on ``llama-micro`` in the CPU smoke run; its JSON as lora.json.

Sized for ~45 s on an H100/H200 (run.py's time box: 55 s): 32 adapters (Zipf popularity) over 8 device
slots, 80 requests at 40/s (2 s a mode) of 16 output tokens, four modes, each on an engine of its own
(built, 32 adapters read from storage, freed before the next), then the kernels on two more. GPU
memory: 15 GiB of weights + 2 GiB of KV + the slots (320 MiB each at 8B, every target at rank 64):
10 GiB for cached's 32, 2.5 GiB for the others' 8: ~28 GiB at most, one engine at a time."""

from __future__ import annotations

from elastune_bench.device.common import part_args

FULL_ARGS = ("--device", "cuda", "--shape", "llama-3-8b", "--requests", "80", "--adapters", "32",
             "--rate", "40", "--modes", "cached,cpu_assisted,async,ondmd")  # fmt: skip
SMOKE_ARGS = ("--device", "cpu", "--shape", "llama-micro", "--requests", "8", "--adapters", "8",
              "--rate", "40", "--modes", "cached,cpu_assisted,ondmd")  # fmt: skip


def bench_argv(out: str, smoke: bool) -> list[str]:
    return ["--quick", *(SMOKE_ARGS if smoke else FULL_ARGS), "--json", out]


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    from elastune_bench.serving import lora

    return lora.main(bench_argv(str(args.out / "lora.json"), args.smoke))


if __name__ == "__main__":
    raise SystemExit(main())
