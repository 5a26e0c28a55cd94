"""Part c1: ``elastune bench lora`` on the device: CaraServe's cold-start modes with real host-to-device
adapter copies (nothing emulated on CUDA) and the padded and unpadded kernels; its JSON as lora.json."""

from __future__ import annotations

from elastune_worker.bench.device.common import part_args


def bench_argv(out: str, smoke: bool) -> list[str]:
    if smoke:
        return ["--quick", "--device", "cpu", "--requests", "8", "--adapters", "8", "--rate", "40",
                "--modes", "cached,cpu_assisted,ondmd", "--json", out]  # fmt: skip
    return ["--quick", "--device", "cuda", "--requests", "120", "--adapters", "128", "--rate", "40",
            "--modes", "cached,cpu_assisted,async,ondmd", "--json", out]  # fmt: skip


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    from elastune_worker.bench import lora

    return lora.main(bench_argv(str(args.out / "lora.json"), args.smoke))


if __name__ == "__main__":
    raise SystemExit(main())
