"""API keys at the gateway (issue 25 items 2-3): Bearer authentication against the hashed key map the
operator publishes (``elastune_contract.api_keys``), the key's model scope, and per-key requests/min and
tokens/min counted in Redis so the limits hold across gateway replicas.

The hot path costs one dict lookup of the key's SHA-256 (the map is re-read with the registry, every
``auth_refresh_s``) and, for a key with limits, a share of one pipelined Redis round trip: every request
still INCRs the minute's request counter (and reads its token counter) in Redis before it is admitted,
but the requests that arrive in the same turn of the event loop share one pipeline, which also carries
the tokens of the answers finished since the last one (INCRBY; a timer sends them within
``TOKEN_FLUSH_S`` when no request comes). Profiled (`elastune bench gateway`), the Redis client's
round trips were the largest cost left after the upstream client; this keeps their count, not their
exactness, down, and the pipelines go through a minimal client (``resp.py``) rather than redis-py's.
A key already over a limit in this window is refused from memory, without Redis.
Windows are fixed minutes: a burst at a window's edge may reach twice the
limit over 60 s, as with every fixed-window limiter. When Redis cannot count, a key with limits gets 503
with Retry-After (``limits_on_redis_outage: closed``, the default: a tenant's quota is a contract with
the others, and uncounted requests would let one key take the fleet for the outage's length), or is let
through uncounted (``open``); counted and logged once either way.

Authentication does not follow Redis's liveness (issue 38 item 2). The map as published carries a meta
field (``api_keys.MAP_META_FIELD``); a read that finds it confirms the map (an empty published map
revokes every key). A read that finds no map (Redis restarted empty, a FLUSHALL) revokes nothing: the
last confirmed map stays in force until the operator re-publishes (every few seconds). When the map
cannot be confirmed for ``stale_s`` (Redis down, or no publisher), every request gets 503 with
Retry-After: a key removed during an outage stops working within that bound (fail closed), and a valid
key is told to retry, never 401.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis

from elastune_contract.api_keys import (
    RATE_WINDOW_SECONDS,
    ApiKeyRecord,
    api_keys_key,
    key_digest,
    map_meta,
    parse_map,
    rate_key,
)
from elastune_contract.openai_api.errors import APIError
from elastune_contract.protocol import PASSWORD_ENV, USERNAME_ENV

from .metrics import GatewayMetrics
from .resp import PipelineClient, RedisUnavailable, ReplyError
from .tls import redis_context

log = logging.getLogger("elastune.gateway")

AuthMode = Literal["required", "off"]
DEFAULT_AUTH_STALE_S = 30.0
"""How long the last confirmed key map is trusted without a new confirmation (settings.auth_stale_s)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request: its key's digest and record."""

    digest: str
    record: ApiKeyRecord

    @property
    def name(self) -> str:
        return self.record.secret

    @property
    def namespace(self) -> str:
        """The namespace of the key's Secret: the caller's, in which a served name is resolved first
        (its own adapters), then the base models of the WarmPools that admit it (directory.py)."""
        return self.record.secret.partition("/")[0]


@dataclass
class _Window:
    requests: int = 0
    tokens: int = 0


@dataclass
class Quota:
    """What a request learned of its key's limits: the ``x-ratelimit-*`` headers."""

    headers: dict[str, str] = field(default_factory=dict)


def _reset(seconds: float) -> str:
    """OpenAI's duration format of the reset headers (``1s``, ``6m0s``)."""
    s = max(1, int(seconds + 0.999))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class KeyTable:
    """The key map as last read from Redis (digest → record)."""

    def __init__(
        self,
        bus_redis: redis.Redis,
        ns: str,
        metrics: GatewayMetrics,
        stale_s: float = DEFAULT_AUTH_STALE_S,
        retry_after_s: int = 5,
    ) -> None:
        self.redis, self.ns, self.metrics = bus_redis, ns, metrics
        self.stale_s, self.retry_after_s = stale_s, retry_after_s
        self.keys: dict[str, ApiKeyRecord] = {}
        self.read_at: float | None = None
        """When a read last confirmed the map (monotonic); None: never."""
        self.version: int | None = None
        self._failing: str | None = None

    def refresh(self) -> None:
        """Blocking (run in a thread): re-read the map. A failed read, or no published map, keeps the
        last confirmed one (its age grows toward ``stale_s``)."""
        try:
            raw = cast(dict[str, str], self.redis.hgetall(api_keys_key(self.ns)))
        except redis.RedisError as exc:
            self._unconfirmed(f"cannot read the API key map: {exc}")
            return
        meta = map_meta(raw)
        if meta is None:
            self._unconfirmed("no API key map is published (Redis restarted empty or flushed?)")
            return
        if self._failing:
            log.info("the API key map is confirmed again (version %d, %d keys)", meta.version, meta.keys)
        self._failing = None
        keys, bad = parse_map(raw)
        if bad:
            self.metrics.poison_records.labels("api_key").inc(bad)
        self.keys, self.read_at, self.version = keys, time.monotonic(), meta.version

    def _unconfirmed(self, why: str) -> None:
        if self._failing != why:
            log.warning(
                "%s; keeping the last confirmed map (refused after %.0f s unconfirmed)", why, self.stale_s
            )
        self._failing = why

    def confirmed_age(self) -> float | None:
        """Seconds since a read last confirmed the map; None: never."""
        return None if self.read_at is None else time.monotonic() - self.read_at

    def authenticate(self, authorization: str | None) -> Principal:
        if authorization:  # no key is refused whatever the map says; a key needs a confirmed map
            age = self.confirmed_age()
            if age is None or age > self.stale_s:
                self.metrics.rejected.labels("keys_unconfirmed").inc()
                since = "never" if age is None else f"{age:.0f} s ago"
                raise APIError(
                    503, f"API keys cannot be confirmed right now (the key map was last confirmed {since}); "
                    "retry shortly",
                    headers={"Retry-After": str(self.retry_after_s)},
                )  # fmt: skip
        if not authorization:
            self.metrics.rejected.labels("unauthenticated").inc()
            raise APIError(
                401, "You didn't provide an API key. You need to provide your API key in an Authorization "
                "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
        scheme, _, key = authorization.strip().partition(" ")
        digest = key_digest(key.strip()) if scheme.lower() == "bearer" and key.strip() else ""
        record = self.keys.get(digest) if digest else None
        if record is None:
            self.metrics.rejected.labels("unauthenticated").inc()
            raise APIError(
                401, "Incorrect API key provided. Give a key from a Secret labelled elastune.dev/api-key.",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
        return Principal(digest, record)

    def authorize(self, principal: Principal, model: str) -> None:
        if model not in principal.record.models:
            self.metrics.rejected.labels("forbidden").inc()
            raise APIError(403, f"The API key {principal.name} may not use the model `{model}`.", "model")


_EXPIRY = 2 * RATE_WINDOW_SECONDS
TOKEN_FLUSH_S = 0.05
"""Longest delay before a finished request's tokens reach Redis when no other request carries them."""


@dataclass
class _Admission:
    """One request waiting for the next pipeline: its key, window, the tokens it reserves and where its
    counts go."""

    principal: Principal
    window: int
    reply: asyncio.Future[_Window | None]
    reserve: int = 0


@dataclass
class Reservation:
    """The tokens a request reserved against its key's tokens/min at admission (issue 39 item 4): its
    prompt estimate plus its max_tokens, settled with what it used when its answer ends."""

    principal: Principal
    window: int
    tokens: int


class RateLimiter:
    """Per-key requests/min and tokens/min in Redis; concurrent requests share pipelined round trips."""

    def __init__(
        self,
        url: str,
        ns: str,
        metrics: GatewayMetrics,
        socket_timeout: float = 2.0,
        *,
        fail_closed: bool = True,
        retry_after_s: int = 5,
    ) -> None:
        self.fail_closed, self.retry_after_s = fail_closed, retry_after_s
        self.redis = PipelineClient(
            url, socket_timeout, os.environ.get(USERNAME_ENV) or None, os.environ.get(PASSWORD_ENV) or None,
            ssl_context=redis_context(url),  # rediss://: the CA of $ELASTUNE_REDIS_CA_FILE (server/tls.py)
        )  # fmt: skip
        self.ns, self.metrics = ns, metrics
        self._over: dict[str, tuple[int, str]] = {}
        """digest → (window, which limit) for keys known to be over a limit in that window."""
        self._failing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._waiting: list[_Admission] = []
        self._tokens: dict[tuple[str, int], int] = {}
        """(digest, window) → tokens to add in Redis (negative: reservations given back)."""
        self._flush_due = False
        self._timer: asyncio.TimerHandle | None = None

    async def close(self) -> None:
        if self._tokens or self._waiting:
            self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.close()

    # -- batching ---------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """A pipeline for whatever is waiting, at the end of this turn of the event loop."""
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, []
        tokens, self._tokens = self._tokens, {}
        if not waiting and not tokens:
            return
        task = asyncio.get_running_loop().create_task(self._execute(waiting, tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, waiting: list[_Admission], tokens: dict[tuple[str, int], int]) -> None:
        pipe: list[tuple[str | bytes | int, ...]] = []
        for (digest, window), n in tokens.items():  # before the admissions below, which then include them
            key = rate_key(self.ns, digest, "tokens", window)
            pipe += [("INCRBY", key, n), ("EXPIRE", key, _EXPIRY)]
        slots: list[tuple[int | None, int | None]] = []
        for a in waiting:
            rec, request_at, tokens_at = a.principal.record, None, None
            if rec.requests_per_minute is not None:
                key = rate_key(self.ns, a.principal.digest, "requests", a.window)
                request_at = len(pipe)
                pipe += [("INCR", key), ("EXPIRE", key, _EXPIRY)]
            if rec.tokens_per_minute is not None:
                tokens_at = len(pipe)
                key = rate_key(self.ns, a.principal.digest, "tokens", a.window)
                # The reservation is counted at once (every replica sees it): the total after it comes back.
                pipe += [("INCRBY", key, a.reserve), ("EXPIRE", key, _EXPIRY)]
            slots.append((request_at, tokens_at))
        replies: list[Any] | None  # ints and bytes once the errors are weeded out
        try:
            replies = cast(list[Any], await self.redis.execute(pipe))
            refused = next((r for r in replies if isinstance(r, ReplyError)), None)
            if refused is not None:
                raise refused
            self._recovered()
        except (RedisUnavailable, ReplyError, OSError) as exc:
            self._failed(exc)
            replies = None
        for a, (request_at, tokens_at) in zip(waiting, slots, strict=True):
            if a.reply.done():
                continue
            if replies is None:
                a.reply.set_result(None)
                continue
            try:
                used = _Window(
                    requests=int(replies[request_at]) if request_at is not None else 0,
                    tokens=int(replies[tokens_at] or 0) if tokens_at is not None else 0,
                )
            except (ValueError, TypeError) as exc:
                self._failed(exc)
                a.reply.set_result(None)
                continue
            a.reply.set_result(used)

    async def admit(self, p: Principal, reserve_tokens: int = 0) -> tuple[Quota, Reservation | None]:
        """Count one request of ``p`` and reserve ``reserve_tokens`` (its prompt estimate + max_tokens)
        against its tokens/min; raise 429 when a limit is used up in this minute, in-flight reservations
        included. The reservation is settled with ``settle`` when the answer ends."""
        rpm, tpm = p.record.requests_per_minute, p.record.tokens_per_minute
        if rpm is None and tpm is None:
            return Quota(), None
        now = time.time()
        window = int(now // RATE_WINDOW_SECONDS)
        reset_in = (window + 1) * RATE_WINDOW_SECONDS - now
        over = self._over.get(p.digest)
        if over is not None and over[0] == window:
            self._refuse(p, over[1], rpm, tpm, reset_in, None)
        reserve = max(0, reserve_tokens) if tpm is not None else 0
        reply: asyncio.Future[_Window | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Admission(p, window, reply, reserve))
        self._schedule()
        used = await reply
        if used is None:  # Redis did not answer (counted, logged once)
            if self.fail_closed:
                raise APIError(
                    503, "Rate limits cannot be counted right now; retry shortly",
                    headers={"Retry-After": str(self.retry_after_s)},
                )  # fmt: skip
            return Quota(), None
        if rpm is not None and used.requests > rpm:
            self._over[p.digest] = (window, "requests")
            self._release(p, window, reserve)
            self._refuse(p, "requests", rpm, tpm, reset_in, used)
        if tpm is not None:
            before = used.tokens - reserve
            # Over once the reservation is in, unless it is the window's first: a request larger than the
            # whole limit is admitted alone rather than never.
            if before >= tpm or (before > 0 and used.tokens > tpm):
                if before >= tpm:
                    self._over[p.digest] = (window, "tokens")
                self._release(p, window, reserve)
                self._refuse(p, "tokens", rpm, tpm, reset_in, _Window(used.requests, max(before, tpm)))
        reservation = Reservation(p, window, reserve) if tpm is not None else None
        return Quota(_headers(rpm, tpm, used, reset_in)), reservation

    def _release(self, p: Principal, window: int, tokens: int) -> None:
        """Give back a refused request's reservation (in its window only)."""
        if tokens > 0:
            self.settle(Reservation(p, window, tokens), 0)

    def _refuse(
        self,
        p: Principal,
        which: str,
        rpm: int | None,
        tpm: int | None,
        reset_in: float,
        used: _Window | None,
    ) -> None:
        self.metrics.rate_limited.labels(p.name, which).inc()
        used = used or _Window(requests=rpm or 0, tokens=tpm or 0)
        if which == "requests":
            used.requests = max(used.requests, rpm or 0)
        else:
            used.tokens = max(used.tokens, tpm or 0)
        headers = _headers(rpm, tpm, used, reset_in)
        headers["Retry-After"] = str(max(1, int(reset_in + 0.999)))
        limit = rpm if which == "requests" else tpm
        unit = "requests" if which == "requests" else "tokens (prompt + completion)"
        raise APIError(
            429, f"Rate limit reached for API key {p.name}: {limit} {unit} per minute. "
            f"Retry after {headers['Retry-After']} s.",
            headers=headers,
        )  # fmt: skip

    def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Replace a request's reservation with the tokens it used (sent with the next pipeline, at the
        latest ``TOKEN_FLUSH_S`` from now). In the window it reserved in, the difference either way; past
        that window only more (a refund there would lower another minute's count)."""
        p = reservation.principal
        if p.record.tokens_per_minute is None:
            return
        window = int(time.time() // RATE_WINDOW_SECONDS)
        delta = used_tokens - reservation.tokens
        if window != reservation.window:
            delta = max(0, delta)
        if delta == 0:
            return
        key = (p.digest, window)
        self._tokens[key] = self._tokens.get(key, 0) + delta
        if self._timer is None and not self._flush_due:
            self._timer = asyncio.get_running_loop().call_later(TOKEN_FLUSH_S, self._schedule)

    def _failed(self, exc: BaseException) -> None:
        self.metrics.rate_limit_errors.inc()
        if not self._failing:
            meanwhile = "refused with 503" if self.fail_closed else "let through uncounted"
            log.warning("cannot count rate limits in Redis (requests with limits %s meanwhile): %s",
                        meanwhile, exc)  # fmt: skip
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.info("rate limits counted in Redis again")
        self._failing = False


def _headers(rpm: int | None, tpm: int | None, used: _Window, reset_in: float) -> dict[str, str]:
    out: dict[str, str] = {}
    if rpm is not None:
        out["x-ratelimit-limit-requests"] = str(rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, rpm - used.requests))
        out["x-ratelimit-reset-requests"] = _reset(reset_in)
    if tpm is not None:
        out["x-ratelimit-limit-tokens"] = str(tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, tpm - used.tokens))
        out["x-ratelimit-reset-tokens"] = _reset(reset_in)
    return out
