"""``elastune gateway`` / ``python -m elastune_gateway.server``: the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from typing import Any

import uvicorn
from pydantic import ValidationError

from elastune_common.side_server import SideServer, serve_beside
from elastune_contract.openai_api.limits import add_limit_args, limits_from
from elastune_contract.protocol import DEFAULT_NAMESPACE

from ..routing.policy import ROUTING_POLICY_NAMES
from .app import create_app, metrics_app
from .http_guard import guarded_protocol
from .service import Gateway
from .settings import GatewaySettings


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="elastune gateway", description=__doc__)
    defaults = GatewaySettings()
    p.add_argument("--redis-url", default=defaults.redis_url, help="the registry workers publish to")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="registry key prefix")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=defaults.metrics_port,
                   help="serve /metrics on this port only (every key's and model's series; keep it where "
                        "clients cannot reach); without it /metrics is on --port with --auth off, and "
                        "nowhere with --auth required")  # fmt: skip
    p.add_argument("--policy", choices=ROUTING_POLICY_NAMES, default=defaults.default_policy,
                   help="routing policy of pools that name none")  # fmt: skip
    p.add_argument("--pool-policy", action="append", default=[], metavar="POOL=POLICY",
                   help="routing policy of one pool, POOL as namespace/name or a name for every "
                   "namespace's pools of it (repeatable)")  # fmt: skip
    p.add_argument("--hold-timeout", type=float, default=defaults.hold_timeout_s,
                   help="seconds a request waits for a warm endpoint, then 503")  # fmt: skip
    p.add_argument("--max-waiting", type=int, default=defaults.max_waiting)
    p.add_argument("--failure-cooldown", type=float, default=defaults.failure_cooldown_s)
    p.add_argument("--read-timeout", type=float, default=defaults.read_timeout_s,
                   help="seconds to wait for a worker's status line, then 504")  # fmt: skip
    p.add_argument("--stream-idle-timeout", type=float, default=defaults.stream_idle_timeout_s,
                   help="longest silence between two chunks of a stream, then an error event")  # fmt: skip
    p.add_argument("--request-head-timeout", type=float, default=defaults.request_head_timeout_s,
                   help="seconds a client may take to send a request's headers, then 408")  # fmt: skip
    p.add_argument("--request-body-timeout", type=float, default=defaults.request_body_timeout_s,
                   help="seconds a client may take to send a request's body after its headers")  # fmt: skip
    p.add_argument("--max-request-head-bytes", type=int, default=defaults.max_request_head_bytes,
                   help="largest request line and headers; more: 431")  # fmt: skip
    p.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens,
                   help="completion tokens a request without max_tokens reserves against its key's "
                        "tokens/min at admission")  # fmt: skip
    p.add_argument("--auth-stale", type=float, default=defaults.auth_stale_s,
                   help="seconds the last confirmed API key map stays in force when it cannot be "
                        "confirmed (Redis down); then 503 + Retry-After")  # fmt: skip
    p.add_argument("--length-predictor-url", default=None,
                   help="SSJF predictor (python -m elastune_ssjf); without it: FCFS")  # fmt: skip
    add_limit_args(p.add_argument_group("request limits (bodies over the size: 413; the others: 400)"),
                   defaults.request_limits())  # fmt: skip
    p.add_argument("--auth", choices=("required", "off"), default=defaults.auth,
                   help="required: /v1 requests need an API key (Authorization: Bearer; keys from the map "
                        "the operator publishes from labelled Secrets); off: anyone who reaches the port "
                        "may use it")  # fmt: skip
    p.add_argument("--limits-on-redis-outage", choices=("closed", "open"),
                   default=defaults.limits_on_redis_outage,
                   help="a key with limits when Redis cannot count them: closed: 503 + Retry-After; "
                        "open: let through uncounted")  # fmt: skip
    p.add_argument("--vouched-only", action="store_true",
                   help="forward only to workers whose id and address a pool record vouches for (the "
                        "chart's default); without it, a model no pool record vouches for follows the "
                        "registry")  # fmt: skip
    fair = p.add_argument_group(
        "fair sharing across API keys (requests beyond what the endpoints run at once "
        "wait in per-key queues served by virtual token counters)"
    )
    fair.add_argument(
        "--fair-share",
        choices=("on", "off"),
        default="on" if defaults.fair_share else "off",
        help="off: forward every request at once (the engine queues them FCFS)",
    )
    fair.add_argument(
        "--endpoint-max-inflight",
        type=int,
        default=defaults.endpoint_max_inflight,
        help="requests one endpoint gets at once (0: the batch size it publishes)",
    )
    fair.add_argument(
        "--max-queued-per-key",
        type=int,
        default=defaults.max_queued_per_key,
        help="queued requests per key; more: 429",
    )
    fair.add_argument(
        "--max-queued", type=int, default=defaults.max_queued, help="queued requests in all; more: 503"
    )
    fair.add_argument("--queue-timeout", type=float, default=defaults.queue_timeout_s,
                      help="seconds a request waits for a free slot, then 503")  # fmt: skip
    p.add_argument("--request-credential-ttl", type=float, default=defaults.request_credential_ttl_s,
                   help="seconds the credential signed onto each forwarded request lives (the key: "
                        "$ELASTUNE_REQUEST_KEY_FILE or $ELASTUNE_REQUEST_KEY)")  # fmt: skip
    p.add_argument("--worker-ca-file", default=os.environ.get("ELASTUNE_WORKER_CA_FILE") or None,
                   help="CA bundle of the workers' certificates: reach them over HTTPS only, verified "
                        "against it [$ELASTUNE_WORKER_CA_FILE]")  # fmt: skip
    p.add_argument("--worker-tls-server-name", default=defaults.worker_tls_server_name,
                   help="the DNS name every worker certificate carries")  # fmt: skip
    p.add_argument("--log-level", default="info")
    return p


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    pools: dict[str, Any] = {}  # validated into RoutingPolicyName by GatewaySettings
    for item in args.pool_policy:
        pool, sep, policy = item.partition("=")
        if not sep or not pool:
            raise SystemExit(f"--pool-policy takes POOL=POLICY, got {item!r}")
        pools[pool] = policy
    try:
        return GatewaySettings(
            redis_url=args.redis_url, namespace=args.namespace, default_policy=args.policy,
            pool_policies=pools, hold_timeout_s=args.hold_timeout, max_waiting=args.max_waiting,
            failure_cooldown_s=args.failure_cooldown, read_timeout_s=args.read_timeout,
            stream_idle_timeout_s=args.stream_idle_timeout, auth_stale_s=args.auth_stale,
            default_max_tokens=args.default_max_tokens,
            length_predictor_url=args.length_predictor_url, auth=args.auth, vouched_only=args.vouched_only,
            fair_share=args.fair_share == "on", endpoint_max_inflight=args.endpoint_max_inflight,
            max_queued_per_key=args.max_queued_per_key, max_queued=args.max_queued,
            queue_timeout_s=args.queue_timeout, metrics_port=args.metrics_port,
            limits_on_redis_outage=args.limits_on_redis_outage,
            request_credential_ttl_s=args.request_credential_ttl,
            request_head_timeout_s=args.request_head_timeout,
            request_body_timeout_s=args.request_body_timeout,
            max_request_head_bytes=args.max_request_head_bytes,
            worker_ca_file=args.worker_ca_file, worker_tls_server_name=args.worker_tls_server_name,
            **dataclasses.asdict(limits_from(args)),
        )  # fmt: skip
    except ValidationError as exc:
        raise SystemExit(f"elastune gateway: invalid settings: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request otherwise
    settings = settings_from(args)
    if settings.auth == "off" and args.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("elastune.gateway").warning(
            "authentication is off (--auth=off) and the gateway listens on %s: anyone who reaches it may use "
            "every model", args.host,
        )  # fmt: skip
    gateway = Gateway(settings)
    app = create_app(gateway)
    if settings.metrics_port is None:
        if settings.auth == "required":
            logging.getLogger("elastune.gateway").warning(
                "no --metrics-port: /metrics is not served (it names every tenant's keys and models)"
            )
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    http=_guard(settings))  # fmt: skip
        return 0
    asyncio.run(_serve_with_metrics(app, metrics_app(gateway), args, settings))
    return 0


def _guard(s: GatewaySettings) -> type[Any]:
    """uvicorn's HTTP protocol with a cap on request heads and read timeouts (it has neither)."""
    return guarded_protocol(s.max_request_head_bytes, s.request_head_timeout_s, s.request_body_timeout_s)


async def _serve_with_metrics(app: Any, metrics: Any, args: argparse.Namespace, s: GatewaySettings) -> None:
    assert s.metrics_port is not None
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, http=_guard(s)))  # fmt: skip
    scraper = SideServer(uvicorn.Config(metrics, host=args.host, port=s.metrics_port, lifespan="off",
                                            log_level=args.log_level, access_log=False,
                                            http=_guard(s)))  # fmt: skip
    await serve_beside(server.serve(), scraper, scraper.serve())


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
