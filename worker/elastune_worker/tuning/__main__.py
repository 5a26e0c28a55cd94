"""Run one worker of a tuning job from the command line (tests, benchmarks, debugging a pod by hand).

    python -m elastune_worker.tuning --model-dir DIR --dataset URI --config '{"batch_size": 8, ...}' \
        [--worker W --world N --channel redis://host:6379/0 --job JOB] [--checkpoint-dir DIR] \
        [--artifact-dir DIR] [--state-out FILE] [--result-out FILE]

Prints one JSON line per step on stdout and exits 0 when the run finishes. The eval split comes from
``--eval-dataset`` when given, else from ``--eval-fraction``/``--max-eval`` of ``--dataset``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_worker.tuning", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--dataset", required=True, help="JSONL path or file:// URI")
    p.add_argument("--eval-dataset", help="JSONL of eval records (default: split off --dataset)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--max-eval", type=int, default=64)
    p.add_argument("--config", default="{}", help="TuningConfig fields as JSON, or @file.json")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--channel", help="storage channel URL (required when --world > 1)")
    p.add_argument("--job", default="tuning", help="job key of the all-reduce (unique per attempt)")
    p.add_argument("--timeout", type=float, default=60.0, help="all-reduce timeout in seconds")
    p.add_argument("--checkpoint-dir", type=Path)
    p.add_argument("--artifact-dir", type=Path)
    p.add_argument("--state-out", type=Path, help="torch.save the final trainable parameters here")
    p.add_argument("--result-out", type=Path, help="write the TuningResult as JSON here")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    args = p.parse_args(argv)

    import torch

    from elastune_worker.tuning.data import load_dataset, split
    from elastune_worker.tuning.trainer import StepInfo, Trainer, TuningConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    raw = args.config
    cfg = TuningConfig(**json.loads(Path(raw[1:]).read_text() if raw.startswith("@") else raw))
    records = load_dataset(args.dataset)
    if args.eval_dataset:
        train, evals = records, load_dataset(args.eval_dataset)
    else:
        train, evals = split(records, args.eval_fraction, args.max_eval, cfg.seed)

    allreduce = None
    if args.channel:
        from elastune_worker.comm import StorageAllReduce, make_channel

        allreduce = StorageAllReduce(
            make_channel(args.channel), args.job, args.worker, args.world, timeout_s=args.timeout
        )
    elif args.world > 1:
        p.error("--world > 1 needs --channel")

    trainer = Trainer(
        args.model_dir,
        cfg,
        train,
        evals,
        worker=args.worker,
        world=args.world,
        allreduce=allreduce,
        checkpoint_dir=args.checkpoint_dir,
    )

    def report(info: StepInfo) -> None:
        print(json.dumps(dataclasses.asdict(info)), flush=True)

    result = trainer.run(progress_cb=report)
    if args.state_out:
        torch.save(trainer.trainable_state(), args.state_out)
    if args.artifact_dir:
        trainer.save_artifact(args.artifact_dir)
    if args.result_out:
        args.result_out.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(json.dumps({"done": True, "iterations": result.iterations, "reason": result.termination_reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
