"""Part c2: ``elastune bench coserve`` on the device: co-serving's finetuning throughput against
temporal sharing at their SLO attainment, the tiny Llama served and tuned on the GPU (FlexLLM's
claim is 1.9-4.8x on GPUs); its JSON as coserve.json. The ShareGPT trace comes from
``$ELASTUNE_DATASET`` (tools/device_check.sh points it at the carried copy) or ../shared/datasets."""

from __future__ import annotations

import os

from elastune_worker.bench.device.common import part_args


def bench_argv(out: str, smoke: bool) -> list[str]:
    argv = ["--quick", "--json", out]
    if os.environ.get("ELASTUNE_DATASET"):
        argv += ["--dataset", os.environ["ELASTUNE_DATASET"]]
    if smoke:
        return [*argv, "--device", "cpu", "--requests", "6", "--max-output", "4", "--light-rate", "40",
                "--heavy-rate", "80", "--modes", "coserve,temporal_16"]  # fmt: skip
    return [*argv, "--device", "cuda", "--requests", "60", "--modes", "coserve,temporal_16,temporal_64"]


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    from elastune_worker.bench import coserve

    return coserve.main(bench_argv(str(args.out / "coserve.json"), args.smoke))


if __name__ == "__main__":
    raise SystemExit(main())
