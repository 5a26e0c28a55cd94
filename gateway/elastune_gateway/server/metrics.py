"""The gateway's Prometheus metrics (one registry per app), named in Prometheus style under
``elastune_gateway_``: requests by outcome, latency seen by clients, routing decisions, upstream
failures, the waiting room, and the endpoints known per model.

Per-model series carry ``model_namespace`` next to ``model`` (issue 25 item 1): a LoRA adapter is
(namespace, name), so two namespaces' ``summarizer`` are two series; for a base model it is its
WarmPool's namespace ("" when no pool record says, or for a request whose model is unknown). It is not
called ``namespace``: the scrape's target label of that name is the gateway pod's own namespace (the
chart's ServiceMonitor honours the gateway's labels, which would overwrite it)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Children(Generic[M]):
    """A metric's children by label values, bound once: ``labels()`` takes a lock and checks its
    arguments on every call, which the hot path (several labelled metrics per request) paid each time.
    Label sets stay as bounded as the metric's own (a child, once made, lives in the metric anyway)."""

    __slots__ = ("_bound", "metric")

    def __init__(self, metric: M) -> None:
        self.metric: M = metric
        self._bound: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> M:
        child = self._bound.get(values)
        if child is None:
            child = self._bound[values] = self.metric.labels(*values)
        return child


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "elastune_gateway_requests", "Requests answered, by model and HTTP status",
            ["model_namespace", "model", "code"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "elastune_gateway_rejected_requests",
            "Requests refused by the gateway itself, by reason (unknown_model, invalid, context, "
            "no_endpoint, waiting_room_full)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.routed = Counter(
            "elastune_gateway_routed_requests", "Requests sent to an endpoint, by model, endpoint and policy",
            ["model_namespace", "model", "endpoint", "policy"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "elastune_gateway_routing_decisions",
            "Routing decisions of policies that make kinds of them, by model, policy and decision (Preble's "
            "E2: exploit | rebalance | explore | pd-balance)",
            ["model_namespace", "model", "policy", "decision"], registry=r,
        )  # fmt: skip
        self.upstream_failures = Counter(
            "elastune_gateway_upstream_failures",
            "Requests an endpoint failed, by kind (connect, unavailable, midstream, timeout)",
            ["endpoint", "kind"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "elastune_gateway_retried_requests", "Requests sent to another endpoint after a failure",
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "elastune_gateway_time_to_first_byte_seconds",
            "Arrival at the gateway to the first streamed byte from the worker", ["model_namespace", "model"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "elastune_gateway_request_duration_seconds", "Arrival to the last byte of the answer",
            ["model_namespace", "model"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.held = Histogram(
            "elastune_gateway_hold_seconds", "Time requests waited for a warm endpoint",
            ["model_namespace", "model"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.waiting = Gauge(
            "elastune_gateway_waiting_requests", "Requests waiting for a warm endpoint",
            ["model_namespace", "model"], registry=r,
        )  # fmt: skip
        self.inflight = Gauge("elastune_gateway_inflight_requests", "Requests being served", registry=r)
        self.endpoints = Gauge(
            "elastune_gateway_endpoints", "Endpoints per model and state (up, down)", ["model", "state"],
            registry=r,
        )  # fmt: skip
        self.predictions = Counter(
            "elastune_gateway_length_predictions", "SSJF output-length predictions, by outcome (ok, failed)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.registry_refresh_failures = Counter(
            "elastune_gateway_registry_refresh_failures",
            "Registry reads that failed (Redis unreachable): the gateway routed on from its last view",
            registry=r,
        )
        self.registry_age = Gauge(
            "elastune_gateway_registry_age_seconds",
            "Seconds since the registry was last read successfully (the age of the view routing uses)",
            registry=r,
        )
        self.poison_records = Counter(
            "elastune_gateway_poison_records",
            "Malformed registry entries skipped (each counted once), by kind (worker, pool, ...)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.unvouched = Gauge(
            "elastune_gateway_unvouched_endpoints",
            "Serving worker records skipped at the last registry read because the control plane does not "
            "vouch for their id and address, by reason (id, unlisted, address, no_pool_record)",
            ["reason"], registry=r,
        )  # fmt: skip
        self.unvouched_records = Counter(
            "elastune_gateway_unvouched_records",
            "Distinct worker records (id, URL) skipped as unvouched, each counted and logged once, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.predictor_configured = Gauge(
            "elastune_gateway_length_predictor_configured",
            "1 when an SSJF length predictor is configured (else requests queue FCFS)", registry=r,
        )  # fmt: skip
        # Per API key (label: the key's Secret as namespace/name, never the key).
        self.key_requests = Counter(
            "elastune_gateway_key_requests", "Requests answered per API key and HTTP status", ["key", "code"],
            registry=r,
        )  # fmt: skip
        self.key_tokens = Counter(
            "elastune_gateway_key_tokens", "Tokens used per API key, by kind (prompt, completion)",
            ["key", "kind"], registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            "elastune_gateway_rate_limited_requests",
            "Requests refused with 429 per API key and limit (requests, tokens)", ["key", "limit"],
            registry=r,
        )  # fmt: skip
        self.rate_limit_errors = Counter(
            "elastune_gateway_rate_limit_errors",
            "Rate-limit counts Redis did not answer (the request got 503 with limits failing closed, else "
            "was let through)", registry=r,
        )  # fmt: skip
        # The hot path's labelled metrics, pre-bound (see Children).
        self.requests_of = Children(self.requests)
        self.key_requests_of = Children(self.key_requests)
        self.key_tokens_of = Children(self.key_tokens)
        self.routed_of = Children(self.routed)
        self.decisions_of = Children(self.decisions)
        self.ttft_of = Children(self.ttft)
        self.latency_of = Children(self.latency)
        self.rejected_of = Children(self.rejected)
