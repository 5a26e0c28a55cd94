"""The request path: resolve the model, predict the output length (SSJF), hold the request while the
pool has no warm endpoint, pick an endpoint with the pool's routing policy, forward, relay the answer.

Every failure ends as an OpenAI-shaped error: unknown model 404, bad body 400 (before anything is
routed), no warm endpoint within the hold timeout 503 + Retry-After, waiting room full 429, an endpoint
that fails before answering → the next endpoint (up to ``max_attempts``), one that fails mid-stream → an
error event in the stream; the failing endpoint gets no new requests for ``failure_cooldown_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import httpx

from elastune_common.bus import Bus
from elastune_contract.api_keys import TENANT_HEADER
from elastune_contract.openai_api.errors import APIError, sse_error
from elastune_contract.openai_api.protocol import ChatCompletionRequest, CompletionRequest, _Request
from elastune_contract.protocol import NAMESPACE_HEADER, ServingDemand, base_model_id

from ..routing.factory import make_router
from ..routing.policy import NoEndpointError, RequestView, Router, RoutingPolicyName
from .auth import KeyTable, RateLimiter
from .call import Answer, Call, Stream, Whole
from .directory import Directory, Endpoint, KnownModel
from .fair_line import FairLine, Ticket
from .forward import EndpointTimeout, EndpointUnavailable, open_response
from .ledger import InFlight, Ledger
from .length_predictor import LengthPredictor
from .metrics import GatewayMetrics
from .prompt_key import chat_key, text_key
from .request_signer import RequestSigner, signer_from_env
from .settings import GatewaySettings
from .tls import worker_context
from .upstream import ConnectionLost, Limits, ReadTimeout, UpstreamPool, UpstreamResponse
from .views import endpoint_view

log = logging.getLogger("elastune.gateway")

DEFAULT_OUTPUT_ESTIMATE = 16
"""Output tokens assumed for a request that names no limit and has no prediction (OpenAI's default
max_tokens of a completion), until its usage says."""

SLO_HEADERS = {"ttft": "x-slo-ttft-ms", "tpot": "x-slo-tpot-ms"}
"""Per-request SLO hints in llm-d's style; they override the pool's SLOs for routing."""
PRIORITY_HEADER = "x-elastune-priority"
SILENCE_POLL_S = 0.5
"""How often a request waiting for a worker's status line checks that the worker is still there."""
"""On the answer to a request whose client-set ``priority`` was not honoured: ``ignored``."""


class Gateway:
    def __init__(self, settings: GatewaySettings, bus: Bus | None = None) -> None:
        self.settings = settings
        self.bus = bus or Bus(settings.redis_url, settings.namespace, socket_timeout=5.0)
        self.metrics = GatewayMetrics()
        self.directory = Directory(
            self.bus, settings.failure_cooldown_s, self.metrics, vouched_only=settings.vouched_only
        )
        self.ledger = Ledger()
        self.metrics.predictor_configured.set(1 if settings.length_predictor_url else 0)
        self._routers: dict[str, tuple[RoutingPolicyName, Router]] = {}
        self._waiting: dict[str, list[float]] = {}
        self._client: httpx.AsyncClient | None = None
        """For the length predictor only (requests to workers go through ``_upstream``)."""
        self._upstream: UpstreamPool | None = None
        self.predictor: LengthPredictor | None = None
        self._refresher: asyncio.Task[None] | None = None
        self.keys: KeyTable | None = None
        self.limiter: RateLimiter | None = None
        if settings.auth == "required":
            self.keys = KeyTable(
                self.bus.redis, settings.namespace, self.metrics, settings.auth_stale_s,
                settings.retry_after_s,
            )  # fmt: skip
            self.limiter = RateLimiter(
                settings.redis_url, settings.namespace, self.metrics,
                fail_closed=settings.limits_on_redis_outage == "closed", retry_after_s=settings.retry_after_s,
            )  # fmt: skip
        self.signer: RequestSigner | None = signer_from_env(settings.request_credential_ttl_s)
        """Signs each forwarded request (request_signer.py); None without a key: unsigned requests,
        which workers that hold a key refuse."""
        self._keys_read_at = 0.0
        self._priority_logged: set[str] = set()
        """Keys whose ignored ``priority`` was logged (once per key and process)."""
        self.line: FairLine | None = None
        if settings.fair_share:
            self.line = FairLine(
                settings.max_queued_per_key, settings.max_queued, settings.queue_timeout_s,
                settings.retry_after_s,
            )  # fmt: skip

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self._upstream = UpstreamPool(
            s.connect_timeout_s, s.read_timeout_s, ssl_context=worker_context(s),
            server_hostname=s.worker_tls_server_name, limits=Limits(
                s.upstream_max_header_bytes, s.upstream_max_headers, s.upstream_max_event_bytes,
                s.upstream_max_body_bytes, s.upstream_idle_s, s.upstream_total_timeout_s,
            ),
        )  # fmt: skip
        if s.length_predictor_url:
            timeout = httpx.Timeout(connect=s.connect_timeout_s, read=s.read_timeout_s, write=30.0, pool=None)
            self._client = httpx.AsyncClient(timeout=timeout)
            self.predictor = LengthPredictor(
                s.length_predictor_url, self._client, s.length_predictor_timeout_s
            )
        else:
            log.info("no length predictor configured (--length-predictor-url): requests queue FCFS")
        await self.directory.refresh()
        if self.keys is not None:
            await asyncio.to_thread(self.keys.refresh)
            self._keys_read_at = time.monotonic()
        self._refresher = asyncio.create_task(self._refresh_loop(), name="registry-refresh")

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        if self._upstream is not None:
            await self._upstream.close()
        if self.limiter is not None:
            await self.limiter.close()
        self.bus.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.directory.refresh()
            if self.line is not None:
                self.line.refresh()  # endpoints that came or went change what the line lets in
            due = time.monotonic() - self._keys_read_at >= self.settings.auth_refresh_s
            if self.keys is not None and due:
                await asyncio.to_thread(self.keys.refresh)  # revocations take effect within this period
                self._keys_read_at = time.monotonic()
            now = time.time()
            for model, since in list(self._waiting.items()):
                if since:
                    demand = ServingDemand(
                        model=model, waiting=len(since), oldest_since=min(since), updated_at=now
                    )
                    await asyncio.to_thread(self.directory.post_demand, demand)

    @property
    def upstream(self) -> UpstreamPool:
        if self._upstream is None:
            raise RuntimeError("the gateway is not started")
        return self._upstream

    # -- the request path -------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, call: Call) -> Answer:
        prompt = body.single_prompt() if body.unsupported() is None else ""
        if isinstance(prompt, str):
            key, text, exact = text_key(prompt), prompt, None
        else:
            key, text, exact = tuple(prompt), "", len(prompt)
        return await self._serve("/v1/completions", body, call, key, text, exact)

    async def chat(self, body: ChatCompletionRequest, call: Call) -> Answer:
        turns = [(m.role, m.text()) for m in body.messages]
        text = "".join(f"{role}: {content}\n" for role, content in turns)
        return await self._serve("/v1/chat/completions", body, call, chat_key(turns), text, None)

    async def _serve(
        self,
        path: str,
        body: _Request,
        call: Call,
        key: tuple[int, ...],
        text: str,
        exact_prompt_tokens: int | None,
    ) -> Answer:
        arrived = time.monotonic()
        model = self._resolve(body.model, call)
        call.model, call.namespace = model.name, model.namespace
        bad = body.unsupported()
        if bad is not None:
            self.metrics.rejected_of("invalid").inc()
            raise APIError(400, bad[1], bad[0])
        limit = model.max_model_len
        if exact_prompt_tokens is not None and limit is not None and exact_prompt_tokens >= limit:
            self.metrics.rejected_of("context").inc()
            raise APIError(
                400,
                f"This model's maximum context length is {model.max_model_len} tokens. However, your "
                f"prompt has {exact_prompt_tokens} tokens. Shorten the prompt.",
                "prompt",
            )
        raw = call.raw
        ttft_slo, tpot_slo = _slo_headers(call, model)
        predicted = await self._predict(text)
        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        drop_priority = "priority" in body.model_fields_set and not self._may_set_priority(call)
        set_priority = predicted is not None and ("priority" not in body.model_fields_set or drop_priority)
        rewrite = set_priority or drop_priority
        if body.stream and not wants_usage and not rewrite and body.stream_options is None:
            # The usage event asked for by appending the field: the body is a validated JSON object.
            raw = raw.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'
        elif rewrite or (body.stream and not wants_usage):  # else the client's bytes go as they came
            payload: dict[str, Any] = json.loads(raw)
            if drop_priority:
                del payload["priority"]
            if set_priority:
                payload["priority"] = predicted  # the engine's SJF queue orders by it (lower first)
            if body.stream:
                payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
            raw = json.dumps(payload, separators=(",", ":")).encode()
        view = RequestView(
            id=uuid.uuid4().hex,
            tokens=key,
            adapter=model.adapter,  # what the name resolved to: rank-aware costs need both
            rank=model.adapter_rank,
            predicted_output_tokens=predicted,
            ttft_slo=ttft_slo,
            tpot_slo=tpot_slo,
        )
        if self.line is not None:
            call.ticket = await self._enter_line(model, call, text, exact_prompt_tokens, predicted, body)
        try:
            return await self._forward(path, body, call, model, view, raw, arrived, wants_usage)
        except BaseException:
            if call.ticket is not None:
                call.ticket.release()
            raise

    def _may_set_priority(self, call: Call) -> bool:
        """Whether the caller's ``priority`` goes to the engine (lower first in its priority and sjf
        queues: a client setting it jumps every other key's requests). Without authentication (the
        loopback ``elastune serve``) anyone's does, as before; with it, only a key whose Secret says
        ``allowPriority: "true"``. Any other key's is ignored, not refused: ``priority`` is a vLLM
        extension, a scheduling hint, and OpenAI's own tier field (``service_tier``) is served at the
        tier the account may use, the answer saying which, rather than refused; so clients that always
        send the field keep working. The caller learns it from the answer's ``x-elastune-priority:
        ignored`` header, the operator from a log line once per key; the request is then ordered by the
        gateway's own length prediction (SSJF) when there is one, else as if it had set none."""
        principal = call.principal
        if principal is None or principal.record.allow_priority:
            return True
        call.priority_ignored = True
        if principal.name not in self._priority_logged:
            self._priority_logged.add(principal.name)
            log.info(
                "key %s set `priority`, which its Secret does not allow (allowPriority): ignored "
                "(logged once per key)",
                principal.name,
            )
        return False

    async def _enter_line(
        self,
        model: KnownModel,
        call: Call,
        text: str,
        exact_prompt_tokens: int | None,
        predicted: int | None,
        body: _Request,
    ) -> Ticket:
        """A slot on the model's endpoints, in the fair order across keys (``fair_line.py``); the cost
        charged now is an estimate (prompt: its tokens if known, else about 4 characters a token;
        output: the predicted length, else the request's token limit), settled from the usage."""
        assert self.line is not None
        prompt = exact_prompt_tokens if exact_prompt_tokens is not None else len(text) / 4
        limit = getattr(body, "token_limit", lambda: body.max_tokens)()
        output = predicted if predicted is not None else (limit or DEFAULT_OUTPUT_ESTIMATE)
        if model.max_model_len:
            output = min(output, model.max_model_len)
        client = call.principal.name if call.principal is not None else "-"
        try:
            return await self.line.enter(
                model.served_model, client, prompt, output, lambda: self._capacity(model)
            )
        except APIError as exc:
            reason = {429: "key_queue_full", 503: "queue_full" if "full" in exc.message else "queue_timeout"}
            self.metrics.rejected_of(reason.get(exc.status, "queue")).inc()
            raise

    def _endpoint_cap(self, endpoint: Endpoint) -> int:
        """Requests ``endpoint`` gets at once with fair sharing (0: no bound)."""
        return self.settings.endpoint_max_inflight or endpoint.serving.max_num_seqs

    def _capacity(self, model: KnownModel) -> int | None:
        """What the endpoints of ``model``'s base take at once (None: unbounded, or none warm: the
        scale-from-zero hold takes over)."""
        base = self.directory.base(model)  # through its own pool, not another namespace's
        caps = [self._endpoint_cap(e) for e in self.directory.endpoints(base)]
        if not caps or 0 in caps:
            return None
        return sum(caps)

    async def _forward(
        self,
        path: str,
        body: _Request,
        call: Call,
        model: KnownModel,
        view: RequestView,
        raw: bytes,
        arrived: float,
        wants_usage: bool,
    ) -> Answer:
        tried: set[str] = set()
        for attempt in range(self.settings.max_attempts):
            endpoint = await self._acquire(model, view, frozenset(tried), arrived)
            policy, router = self._router(model)
            # The pick that chose ``endpoint`` was the router's last one (nothing awaited in between).
            decision = getattr(router, "last_decision", None)
            if decision is not None:
                self.metrics.decisions_of(model.namespace, model.name, policy, decision.kind).inc()
            router.on_routed(view, endpoint.id, time.monotonic())
            log.debug(
                "routed %s (adapter %s, rank %d) to %s by %s",
                view.id, view.adapter or "-", view.rank, endpoint.id, policy,
            )  # fmt: skip
            self.metrics.routed_of(model.namespace, model.name, endpoint.id, policy).inc()
            entry = self.ledger.add(
                view, endpoint.id, None if body.stream else self._prefill_estimate(endpoint, view)
            )
            self.metrics.inflight.inc()
            try:
                forwarded = _forwarded_headers(call)
                if model.parent is not None:  # unsigned (dev) path: the worker's id is namespace + name
                    forwarded = {**(forwarded or {}), NAMESPACE_HEADER: model.namespace}
                if self.signer is not None:  # what the worker trusts: namespace, model and key, signed
                    forwarded = {**(forwarded or {}), **self.signer.headers(call, model, endpoint)}
                response = await open_response(
                    self.upstream, endpoint, path, raw, forwarded, self._silent_watch(endpoint.id)
                )
            except EndpointUnavailable as exc:
                self._done(entry, router, 0)
                self.metrics.upstream_failures.labels(endpoint.id, exc.kind).inc()
                self.directory.mark_down(endpoint.id, str(exc))
                tried.add(endpoint.id)
                if attempt + 1 < self.settings.max_attempts:
                    self.metrics.retries.inc()
                continue
            except EndpointTimeout as exc:
                self._done(entry, router, 0)
                self.metrics.upstream_failures.labels(endpoint.id, "timeout").inc()
                raise APIError(  # the endpoint's id names a pod: logged and counted, not told
                    504, "no answer from the endpoint within the read timeout; the request was not retried"
                ) from exc
            if body.stream and response.status_code == 200:
                relay = self._relay(response, entry, router, model, arrived, wants_usage, call)

                def close(
                    response: UpstreamResponse = response, entry: InFlight = entry, router: Router = router
                ) -> None:
                    # A relay that never started never runs its finally: its end is accounted here.
                    response.release()
                    self._done(entry, router, 0)
                    self.give_back(call)  # nothing was relayed: the client left before the first byte
                    if call.ticket is not None:
                        call.ticket.release()

                return Stream(endpoint.id, relay, close)
            whole = await self._whole(response, entry, router, model, arrived, call)
            if call.ticket is not None:
                call.ticket.release()
            return whole
        self.metrics.rejected_of("no_endpoint").inc()
        raise APIError(
            503,
            f"{len(tried)} endpoint(s) of model `{model.name}` failed this request before answering; retry",
            headers={"Retry-After": str(self.settings.retry_after_s)},
        )

    def _resolve(self, name: str, call: Call) -> KnownModel:
        """The model ``name`` means for the caller: resolved in its key's namespace (the rule is in
        directory.py's doc); without authentication, one tenant."""
        namespace = call.principal.namespace if call.principal is not None else None
        model = self.directory.model(name, namespace)
        if model is None:
            self.metrics.rejected_of("unknown_model").inc()
            several = self.directory.namespaces_serving(name) if namespace is None else []
            if len(several) > 1:
                raise APIError(
                    404, f"The model `{name}` is served in several namespaces ({', '.join(several)}); "
                    "call with an API key of the one you mean", "model",
                )  # fmt: skip
            known = self.directory.models(namespace)
            if call.principal is not None:  # only what the key may use, not the rest of its namespace's
                known = {n: m for n, m in known.items() if n in call.principal.record.models}
            available = ", ".join(known) or "none yet"
            raise APIError(404, f"The model `{name}` does not exist. Available: {available}", "model")
        self.directory.count_request(model.id)
        return model

    async def _predict(self, text: str) -> int | None:
        if self.predictor is None or not text:
            return None
        value = await self.predictor.predict(text)
        self.metrics.predictions.labels("ok" if value is not None else "failed").inc()
        return value

    def _router(self, model: KnownModel) -> tuple[RoutingPolicyName, Router]:
        """One router per base model and pool: its adapters' requests share its endpoints' load and
        history."""
        policy = self.settings.policy_for(model.pool, model.routing_policy, model.pool_key)
        key = base_model_id(model.served_model, model.pool_key)  # one per pool of a model
        held = self._routers.get(key)
        if held is None or held[0] != policy:
            held = self._routers[key] = (policy, make_router(policy))
        return held

    def policies(self) -> dict[str, RoutingPolicyName]:
        return {name: self._router(m)[0] for name, m in self.directory.models().items()}

    async def _acquire(
        self, model: KnownModel, view: RequestView, tried: frozenset[str], arrived: float
    ) -> Endpoint:
        """An endpoint for ``view`` now, or after waiting for one up to the pool's hold timeout."""
        hold = model.hold_timeout_s if model.hold_timeout_s is not None else self.settings.hold_timeout_s
        deadline = arrived + hold
        entered: float | None = None
        try:
            while True:
                endpoints = self.directory.endpoints(model, tried)
                if endpoints and self.line is not None:  # those with a free slot, if any has one
                    endpoints = [
                        e for e in endpoints
                        if self.ledger.count(e.id) < (self._endpoint_cap(e) or self.ledger.count(e.id) + 1)
                    ] or endpoints  # fmt: skip
                if endpoints:
                    _, router = self._router(model)
                    views = [endpoint_view(e, self.ledger) for e in endpoints]
                    try:
                        chosen = router.pick(view, views, time.monotonic())
                    except NoEndpointError:
                        chosen = None
                    for e in endpoints:
                        if e.id == chosen:
                            return e
                if model.parent is not None:  # an adapter whose condition says waiting cannot help
                    model = self.directory.adapter(model.namespace, model.name) or model
                    if model.unservable:
                        self.metrics.rejected.labels("unservable").inc()
                        raise APIError(
                            400,
                            f"Model `{model.name}` cannot be served: {model.unservable} (its LoRAAdapter "
                            f"{model.namespace}/{model.name} says so; waiting for a pod would not help)",
                            "model",
                        )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.rejected.labels("no_endpoint").inc()
                    raise APIError(
                        503,
                        f"No warm endpoint of model `{model.name}` became available within {hold:g} s; "
                        "its pool is scaling up, retry later",
                        headers={"Retry-After": str(self.settings.retry_after_s)},
                    )
                if entered is None:
                    if sum(len(v) for v in self._waiting.values()) >= self.settings.max_waiting:
                        self.metrics.rejected.labels("waiting_room_full").inc()
                        raise APIError(
                            429, "Too many requests are waiting for warm endpoints; retry later",
                            headers={"Retry-After": str(self.settings.retry_after_s)},
                        )  # fmt: skip
                    entered = time.time()
                    self._waiting.setdefault(model.id, []).append(entered)
                    self.metrics.waiting.labels(model.namespace, model.name).inc()
                await self.directory.wait_changed(min(remaining, 1.0))
        finally:
            if entered is not None:
                self._waiting[model.id].remove(entered)
                self.metrics.waiting.labels(model.namespace, model.name).dec()
                self.metrics.held.labels(model.namespace, model.name).observe(time.time() - entered)

    def _silent_watch(self, endpoint_id: str) -> Callable[[], Awaitable[str]]:
        """What ``open_response`` races the worker's answer against: the endpoint leaving the directory
        (its registry record expired: a paused or partitioned worker stops heart-beating) or being marked
        down. Until its status line comes the request has not started there, so it goes elsewhere."""

        async def gone() -> str:
            while True:
                await asyncio.sleep(SILENCE_POLL_S)
                if not self.directory.has_endpoint(endpoint_id):
                    return "its registry record expired (no heartbeat: paused or unreachable)"
                if self.directory.is_down(endpoint_id):
                    return "it was marked down"

        return gone

    def _prefill_estimate(self, endpoint: Endpoint, view: RequestView) -> float | None:
        cost = endpoint.serving.cost
        return None if cost is None else cost.prefill_s_per_token * view.prompt_len

    def _done(self, entry: InFlight, router: Router, output_tokens: int) -> None:
        if entry.closed:
            return
        entry.closed = True
        self.ledger.remove(entry)
        self.metrics.inflight.dec()
        router.on_finished(entry.request, entry.endpoint, output_tokens, time.monotonic())

    async def _whole(
        self,
        response: UpstreamResponse,
        entry: InFlight,
        router: Router,
        model: KnownModel,
        arrived: float,
        call: Call,
    ) -> Whole:
        output_tokens = prompt_tokens = 0
        complete = False
        try:
            content = await response.read()
            complete = True
            if response.status_code == 200:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    usage = json.loads(content)["usage"]
                    output_tokens = int(usage["completion_tokens"])
                    prompt_tokens = int(usage.get("prompt_tokens") or 0)
        except ReadTimeout as exc:
            self.metrics.upstream_failures.labels(entry.endpoint, "timeout").inc()
            raise APIError(504, "no answer from the endpoint within the read timeout") from exc  # no pod name
        except ConnectionLost as exc:
            self.metrics.upstream_failures.labels(entry.endpoint, "midstream").inc()
            self.directory.mark_down(entry.endpoint, str(exc))
            raise APIError(502, f"the endpoint serving this request failed: {type(exc).__name__}") from exc
        finally:
            response.release()
            self._done(entry, router, output_tokens)
            self._count_usage(call, prompt_tokens, output_tokens, complete)
        self.metrics.latency_of(model.namespace, model.name).observe(time.monotonic() - arrived)
        media = response.header_bytes(b"content-type") or b"application/json"
        return Whole(response.status_code, media, content, entry.endpoint)

    async def _relay(
        self,
        response: UpstreamResponse,
        entry: InFlight,
        router: Router,
        model: KnownModel,
        arrived: float,
        wants_usage: bool,
        call: Call,
    ) -> AsyncGenerator[tuple[bytes, bool], None]:
        """The worker's SSE events as they come, each with whether it ends the answer; its usage event
        (asked for, to learn the output length) is passed on only when the client asked for it. A worker
        that fails mid-stream ends the stream with an OpenAI error event (the status line went out with
        the first byte)."""
        output_tokens = prompt_tokens = 0
        usage_seen = False
        pending = b""
        first = True
        try:
            async for chunk in response.iter_chunks(self.settings.stream_idle_timeout_s):
                if first:
                    first = False
                    self.ledger.first_byte(entry)
                    self.metrics.ttft_of(model.namespace, model.name).observe(time.monotonic() - arrived)
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                out = []
                for event in events:
                    if b'"usage"' in event:
                        usage_only, tokens = _usage_event(event)
                        usage_seen = usage_seen or tokens is not None
                        output_tokens = tokens if tokens is not None else output_tokens
                        prompt_tokens = _prompt_tokens(event) or prompt_tokens
                        if usage_only and not wants_usage:
                            continue
                    out.append(event + b"\n\n")
                if out:
                    yield b"".join(out), response.complete and not pending.strip()
            if pending.strip():
                yield pending, True
        except (ConnectionLost, ReadTimeout) as exc:
            kind = "timeout" if isinstance(exc, ReadTimeout) else "midstream"
            self.metrics.upstream_failures.labels(entry.endpoint, kind).inc()
            if kind == "midstream":
                self.directory.mark_down(entry.endpoint, f"failed mid-stream: {type(exc).__name__}")
            message = f"the endpoint serving this request failed mid-stream ({type(exc).__name__}); retry"
            yield sse_error(502, message).encode(), True
        finally:
            response.release()  # also when the client went away: an unfinished answer closes its socket
            self._done(entry, router, output_tokens)
            self._count_usage(call, prompt_tokens, output_tokens, usage_seen)
            if call.ticket is not None:
                call.ticket.release()
            self.metrics.latency_of(model.namespace, model.name).observe(time.monotonic() - arrived)

    def give_back(self, call: Call) -> None:
        """A request that ends before a worker answered it: its token reservation is returned."""
        if call.reservation is not None and self.limiter is not None:
            self.limiter.settle(call.reservation, 0)
            call.reservation = None

    def _count_usage(
        self, call: Call, prompt_tokens: int, completion_tokens: int, complete: bool = True
    ) -> None:
        """A key's tokens: in its metrics, against its tokens/min (the reservation made at admission,
        settled in Redis), and in its fair-share counter (the estimate charged when it left the line,
        corrected). ``complete`` False: the answer ended before its usage was known (the client left
        mid-stream): the reservation stands as the charge, never 0."""
        if call.ticket is not None:
            call.ticket.settle(prompt_tokens, completion_tokens)
        principal = call.principal
        if principal is None:
            return
        if prompt_tokens:
            self.metrics.key_tokens_of(principal.name, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.metrics.key_tokens_of(principal.name, "completion").inc(completion_tokens)
        if self.limiter is not None and call.reservation is not None:
            used = prompt_tokens + completion_tokens
            reserved = call.reservation.tokens
            self.limiter.settle(call.reservation, used if complete else max(used, reserved))
            call.reservation = None


def _forwarded_headers(call: Call) -> dict[str, str] | None:
    """What the worker gets besides the body: the client's request id, and the caller's key as the
    tenant the engine's ``fair`` queue shares service across (no header the client sent)."""
    headers: dict[str, str] = {}
    if call.request_id:
        headers["x-request-id"] = call.request_id
    if call.principal is not None:
        headers[TENANT_HEADER] = call.principal.name
    return headers or None


def _prompt_tokens(event: bytes) -> int:
    try:
        usage = json.loads(event.removeprefix(b"data: ").strip()).get("usage") or {}
        return int(usage.get("prompt_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def _usage_event(event: bytes) -> tuple[bool, int | None]:
    """(whether the event carries only usage, its completion_tokens)."""
    data = event.removeprefix(b"data: ").strip()
    try:
        obj = json.loads(data)
        usage = obj.get("usage") or {}
        return (not obj.get("choices"), usage.get("completion_tokens"))
    except (ValueError, AttributeError):
        return (False, None)


def _slo_headers(call: Call, model: KnownModel) -> tuple[float | None, float | None]:
    out: list[float | None] = []
    for name, default, raw in (
        ("ttft", model.ttft_slo_s, call.slo_ttft_ms),
        ("tpot", model.tpot_slo_s, call.slo_tpot_ms),
    ):
        if raw is None:
            out.append(default)
            continue
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise APIError(400, f"header {SLO_HEADERS[name]} must be a positive number of milliseconds", name)
        out.append(value / 1000.0)
    return out[0], out[1]
