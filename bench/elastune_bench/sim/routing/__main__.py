"""Run the routing simulator and print a table: ``python -m elastune_bench.sim.routing --help``.

Examples (the Azure trace and the ShareGPT sample are the ones the repository ships in ``data/``):

    python -m elastune_bench.sim.routing --workload prefix --endpoints 8 --policy roundRobin,leastLoad,preble
    python -m elastune_bench.sim.routing --workload lora --endpoints 60 \
        --policy rankAware,mostIdle,firstFit,random
    python -m elastune_bench.sim.routing --workload multiturn --endpoints 4
    python -m elastune_bench.sim.routing --workload prefix --arrivals azure --trace-scale 0.7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from elastune_gateway.routing.policy import ROUTING_POLICY_NAMES, RoutingPolicyName

from .experiments import DEFAULT_POLICIES, WORKLOADS, Experiment, run_experiment
from .metrics import table


def _policies(text: str) -> list[RoutingPolicyName]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in ROUTING_POLICY_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown policy {n!r}; choose from {', '.join(ROUTING_POLICY_NAMES)}"
            )
    return names  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m elastune_bench.sim.routing", description=__doc__.split("\n")[0]
    )
    p.add_argument("--workload", choices=WORKLOADS, default="prefix")
    p.add_argument("--endpoints", type=int, default=None, help="default: 8 (prefix, multiturn), 60 (lora)")
    p.add_argument("--policy", type=_policies, default=None, help="comma-separated; default per workload")
    p.add_argument("--requests", type=int, default=None, help="requests (conversations for multiturn)")
    p.add_argument(
        "--rate", type=float, default=None, help="Poisson arrivals per second (default per workload)"
    )
    p.add_argument("--arrivals", choices=("poisson", "azure"), default="poisson")
    p.add_argument("--trace", default=None, help="Azure trace CSV (default: data/azure_llm_conv_2023.csv.gz)")
    p.add_argument("--trace-scale", type=float, default=1.0, help="multiplies the trace's arrival times")
    p.add_argument("--trace-lengths", action="store_true", help="lora: prompt/output lengths from the trace")
    p.add_argument(
        "--sharegpt", default=None,
        help="ShareGPT JSON for multiturn (default: $ELASTUNE_DATASET or data/sharegpt_250.json.gz)",
    )  # fmt: skip
    p.add_argument(
        "--documents", type=int, default=None, help="prefix: shared documents (default 8 per endpoint)"
    )
    p.add_argument("--zipf", type=float, default=None)
    p.add_argument("--adapters", type=int, default=None)
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds (lora)")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV-cache tokens per endpoint")
    p.add_argument("--max-adapters", type=int, default=None)
    p.add_argument("--lora-kernel", choices=("padded", "unpadded"), default=None)
    p.add_argument("--local-queue", choices=("auto", "fcfs", "priority"), default="auto")
    p.add_argument("--predict-output", choices=("none", "oracle"), default="none")
    p.add_argument(
        "--warmup", type=float, default=0.1, help="fraction of requests left out of the statistics"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the summaries here")
    args = p.parse_args(argv)

    exp = Experiment(
        workload=args.workload,
        endpoints=args.endpoints,
        requests=args.requests,
        rate=args.rate,
        arrivals=args.arrivals,
        trace=args.trace,
        trace_scale=args.trace_scale,
        trace_lengths=args.trace_lengths,
        sharegpt=args.sharegpt,
        documents=args.documents,
        zipf=args.zipf,
        adapters=args.adapters,
        tpot_slo=args.tpot_slo,
        kv_tokens=args.kv_tokens,
        max_adapters=args.max_adapters,
        lora_kernel=args.lora_kernel,
        local_queue=args.local_queue,
        predict_output=args.predict_output,
        warmup=args.warmup,
        seed=args.seed,
    )
    policies = args.policy or list(DEFAULT_POLICIES[args.workload])
    rows = []
    for name in policies:
        t0 = time.perf_counter()
        result = run_experiment(exp, name)
        rows.append(result.summary)
        print(
            f"# {name}: simulated {result.summary.makespan:.0f} s in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    print(exp.describe())
    print(table(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"experiment": exp.describe(), "rows": [r.as_dict() for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
