"""The serving engine on its own, like ``vllm serve``: an OpenAI-compatible server for one model
directory, with no Redis and no tuning (the worker process adds both).

    python -m elastune_worker.engine --model DIR [--port 8000] [--metrics-port N] [--served-model-name NAME]
        [engine flags]

/metrics is on --port, as ``vllm serve`` has it (one user's server: no gateway, no tenants, and its
series name no more than /v1/models does); --metrics-port moves it to a listener of its own (404 on
--port), as the worker pod always has it.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from elastune_contract.openai_api.limits import add_limit_args
from elastune_worker.engine.api.admission import DEFAULT_MAX_QUEUED_REQUESTS
from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.core.scheduler_config import BatchingName, QueuePolicyName
from elastune_worker.engine.model_runner.cpu_binding import bind_process, plan_here, validate_spec

if TYPE_CHECKING:
    from elastune_worker.engine.frontend.engine_loop import CallHandler

_DEFAULTS = EngineConfig()


def add_engine_args(p: argparse.ArgumentParser, engine_cpus: str = "auto") -> None:
    """The engine's flags; ``engine_cpus``: the default CPU binding (model_runner/cpu_binding.py)."""
    g = p.add_argument_group("engine")
    g.add_argument("--served-model-name", help="the model id clients send (default: --model)")
    g.add_argument(
        "--kv-cache-tokens", type=int, default=_DEFAULTS.kv_cache_tokens, help="KV-cache size in tokens"
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    g.add_argument(
        "--long-prefill-token-threshold", type=int, default=0, help="prefill chunk cap (0: budget)"
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--queue-policy",
        choices=get_args(QueuePolicyName),
        default=_DEFAULTS.queue_policy,
        help="waiting-queue order: fcfs, priority (lower first), sjf (priority = predicted output tokens), "
        "fair (VTC across the API keys the gateway names)",
    )
    g.add_argument(
        "--sjf-max-bypass",
        type=int,
        default=_DEFAULTS.sjf_max_bypass,
        help="sjf starvation guard: overtaken this many times, a request goes first (0: off)",
    )
    g.add_argument(
        "--sjf-max-wait-s",
        type=float,
        default=_DEFAULTS.sjf_max_wait_s,
        help="sjf starvation guard: after waiting this long, a request goes first (0: off)",
    )
    g.add_argument(
        "--batching",
        choices=get_args(BatchingName),
        default=_DEFAULTS.batching,
        help="continuous (every step), dynamic (a new batch when the running set is empty), none",
    )
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    g.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    g.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine on a thread of the server process (default: its own process, as vLLM)",
    )
    g.add_argument(
        "--engine-threads",
        type=int,
        help="torch threads of the engine process (default: one per engine CPU when bound, else torch's)",
    )
    g.add_argument(
        "--engine-cpus",
        type=_cpu_spec,
        default=engine_cpus,
        metavar="auto|none|LIST",
        help="CPUs of a CPU engine process, as vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND: auto (all but the "
        f"last, which the front end keeps; no binding on one CPU), none, or a list such as 0-2,5 "
        f"(default: {engine_cpus})",
    )
    lo = p.add_argument_group("LoRA adapters (vLLM's flags)")
    lo.add_argument(
        "--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)"
    )
    lo.add_argument(
        "--max-loras", type=int, default=_DEFAULTS.max_loras, help="adapters on the device at once"
    )
    lo.add_argument(
        "--max-cpu-loras", type=int, default=_DEFAULTS.max_cpu_loras, help="adapters in host memory"
    )
    lo.add_argument("--max-lora-rank", type=int, default=_DEFAULTS.max_lora_rank)
    lo.add_argument("--lora-kernel", choices=("padded", "unpadded"), default=_DEFAULTS.lora_kernel)
    lo.add_argument(
        "--lora-load-mode", choices=("cpu_assisted", "async", "ondmd", "cached"),
        default=_DEFAULTS.lora_load_mode,
        help="cold start of an adapter not on the device: CaraServe's CPU-assisted prefill (default), "
        "S-LoRA-like async, on demand, or all cached",
    )  # fmt: skip
    lo.add_argument(
        "--lora-cpu-workers", type=int, default=0,
        help="CaraServe's CPU LoRA processes for the cpu_assisted path (0: the engine process computes it)",
    )  # fmt: skip
    lo.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="adapters to load at start (PEFT directories: a path, file:// or pvc://claim/path)",
    )  # fmt: skip
    limits = p.add_argument_group(
        "request limits (bodies over the size: 413; a full queue: 503; the others: 400)"
    )
    add_limit_args(limits)
    limits.add_argument(
        "--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="requests accepted and not yet started (waiting for the engine) at most; then 503 + Retry-After",
    )  # fmt: skip


def _cpu_spec(text: str) -> str:
    try:
        return validate_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lora_modules(args: argparse.Namespace) -> list[tuple[str, str]]:
    out = []
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules takes NAME=PATH, got {item!r}")
        out.append((name, path))
    return out


def load_lora_modules(client: Any, modules: list[tuple[str, str]]) -> None:
    """Loads the start-up adapters through the engine (from a thread without a running event loop)."""
    import asyncio

    for name, path in modules:
        info = asyncio.run(client.load_lora(name, path))
        logging.getLogger("elastune.serving").info(
            "LoRA adapter %s (rank %d) loaded from %s", name, info.rank, path
        )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=not args.no_prefix_caching,
        queue_policy=args.queue_policy,
        sjf_max_bypass=args.sjf_max_bypass,
        sjf_max_wait_s=args.sjf_max_wait_s,
        batching=args.batching,
        device=args.device,
        dtype=args.dtype,
        enable_lora=bool(args.enable_lora or args.lora_modules),
        max_loras=args.max_loras,
        max_cpu_loras=max(args.max_cpu_loras, args.max_loras),
        max_lora_rank=args.max_lora_rank,
        lora_kernel=args.lora_kernel,
        lora_load_mode=args.lora_load_mode,
        lora_cpu_workers=args.lora_cpu_workers,
    )


def start_engine(
    path: Path,
    config: EngineConfig,
    in_thread: bool,
    tokenizer: Any = None,
    threads: int | None = None,
    cpus: str = "auto",
    bind_frontend: bool = False,
    calls: CallHandler | None = None,
) -> Any:
    """The engine in its own process (default), or on a thread of this one. ``cpus``: the engine
    process's CPU binding (model_runner/cpu_binding.py); ``bind_frontend``: this process then keeps to the
    CPUs left over (the serving-only server; the worker's tuning needs every CPU); ``calls``: the engine
    calls beyond adapter management (the worker's co-serving: engine_loop.CallHandler)."""
    log = logging.getLogger("elastune.serving")
    if in_thread:
        from elastune_worker.engine.frontend.async_engine import AsyncEngine
        from elastune_worker.engine.llm_engine import LLMEngine

        return AsyncEngine(LLMEngine(path, config, tokenizer=tokenizer), calls)
    from elastune_worker.engine.frontend.engine_process import ProcessEngine

    plan = plan_here(cpus)
    engine = ProcessEngine(
        path, config, tokenizer=tokenizer, threads=threads, cpus=plan.engine if plan else None, calls=calls
    )
    if plan is not None and engine.engine_cpus is not None:
        log.info("engine process bound to CPUs %s (%d torch threads)", plan.engine, engine.engine_threads)
        if bind_frontend and plan.frontend != plan.engine:
            bind_process(plan.frontend)
            log.info("front end bound to CPUs %s", plan.frontend)
    return engine


def health_router(registry: CollectorRegistry, metrics_here: bool = True) -> APIRouter:
    """/health, and /metrics unless a metrics port serves it (``metrics_here`` False)."""
    router = APIRouter(tags=["health"])

    @router.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    if metrics_here:

        @router.get("/metrics", response_class=Response)
        def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_worker.engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF-format model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics on this port only (default: on --port, as vllm serve)")  # fmt: skip
    add_engine_args(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from elastune_contract.openai_api.limits import limits_from
    from elastune_worker.engine.api.app import create_app
    from elastune_worker.engine.api.metrics import ServingMetrics
    from elastune_worker.engine.frontend.serving_client import EngineServingClient
    from elastune_worker.engine.frontend.streams import EngineError

    name = args.served_model_name or args.model
    try:
        engine = start_engine(
            Path(args.model),
            engine_config(args),
            args.engine_in_thread,
            threads=args.engine_threads,
            cpus=args.engine_cpus,
            bind_frontend=True,
        )
    except (EngineError, ValueError) as exc:  # the model or the settings: one line saying why
        logging.getLogger("elastune.serving").error("the engine cannot start: %s", exc)
        return 1
    client = EngineServingClient(engine, name)
    load_lora_modules(client, lora_modules(args))
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry, name)
    metrics.watch_engine(registry, client.stats, client.lora_info)
    separate = args.metrics_port is not None
    app = create_app(
        lambda: client, metrics=metrics, control=health_router(registry, metrics_here=not separate),
        limits=limits_from(args), max_queued_requests=args.max_queued_requests,
    )  # fmt: skip
    if not separate:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        return 0
    from elastune_worker.engine.api.listeners import ServingServer, listen, metrics_server

    scraper = metrics_server(registry, listen(args.host, args.metrics_port))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    ServingServer(config, scraper).run()
    return 0
