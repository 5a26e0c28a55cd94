"""Every chaos experiment, in the order they run, and the 22 cases of issue 38's Why they keep.

The issue tried 22 fault and bad-input cases on `elastune serve` / `elastune run` as a new user would:
13 held and 9 were lost (its items (1)-(8); (3) counts twice: Redis down and FLUSHALL). Each case is kept
by at least one experiment here (``CASES``: what held means; ``EXPERIMENTS``: which cases each keeps);
``elastune bench chaos --list`` prints both as tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from . import auth_redis, local, operator, serving, workers
from .stack import Outcome, Plan

Site = Literal["stack", "local", "alone"]
"""Where an experiment runs: the main stack, the small local serve with its embedded Redis, or on its
own (it starts what it needs under a folder)."""


@dataclass(frozen=True)
class Case:
    id: str
    what: str
    was: Literal["lost", "held"]
    held_means: str


@dataclass(frozen=True)
class Experiment:
    name: str
    site: Site
    run: Callable[[Any, Plan], Outcome]
    cases: tuple[str, ...]
    breaks: bool = False
    """It stops a part of its stack on purpose: the stack is checked (and restarted if need be) after."""


CASES: tuple[Case, ...] = tuple(
    Case(*row)
    for row in (
        (
            "W1",
            "a worker sent SIGTERM with streams in flight",
            "lost",
            "every stream finishes; it exits after",
        ),
        (
            "W2",
            "a worker paused ~20 s with streams in flight",
            "lost",
            "re-admitted, not stopped; unstarted requests retried elsewhere",
        ),
        (
            "K1",
            "Redis down while a key is removed",
            "lost",
            "the removed key gets 503 + Retry-After past the bound",
        ),
        ("K2", "Redis flushed (FLUSHALL)", "lost", "no valid key gets a 401"),
        (
            "A1",
            "a greedy request through an adapter whose weights overflow",
            "lost",
            "refused at load; never a 200 with empty text",
        ),
        (
            "A2",
            "an adapter that failed to load; a corrupt file loaded directly",
            "lost",
            "a 4xx at once naming the reason; a 400 naming the file",
        ),
        ("I1", "a lone surrogate in a prompt", "lost", "400 at the worker as at the gateway"),
        (
            "L1",
            "local Redis killed, gateway killed, Redis without a password",
            "lost",
            "both restarted with state re-asserted; unauthenticated clients refused",
        ),
        (
            "L2",
            "`elastune run` interrupted and run again",
            "lost",
            "resumes from the newest checkpoint, same id",
        ),
        ("R1", "Redis down under traffic", "held", "served from the last view; back after the restart"),
        ("R2", "the worker's result event refused by Redis", "held", "Succeeded with exactly one result"),
        ("R3", "malformed records and events in the registry", "held", "counted, logged, serving unaffected"),
        (
            "I2",
            "a seed out of range; a request failing in the sampling step",
            "held",
            "400 naming the field; only that request fails",
        ),
        ("I3", "a model that does not exist", "held", "404 at once"),
        ("I4", "malformed request bodies", "held", "400, OpenAI-shaped"),
        ("I5", "oversized request bodies", "held", "413 / 400"),
        ("I6", "no API key, a wrong one", "held", "401"),
        ("W3", "a worker SIGKILLed with streams in flight", "held", "its streams end with an error at once"),
        ("W4", "clients that go away mid-stream", "held", "the engines drop their requests"),
        (
            "W5",
            "a pool whose workers cannot start (crash loop)",
            "held",
            "503 in bounded time; the healthy pool unaffected",
        ),
        ("A3", "an adapter unloaded behind the control plane's back", "held", "loaded again and served"),
        (
            "L3",
            "the operator killed between status and dispatch; `elastune serve` stopped",
            "held",
            "the job runs once more and succeeds once; nothing left running",
        ),
    )
)

EXPERIMENTS: tuple[Experiment, ...] = (
    # The main stack; the TuningJob of result-suppressed runs while the stack starts.
    Experiment("result-suppressed", "stack", auth_redis.exp_result_suppressed, ("R2",)),
    Experiment("bad-key", "stack", auth_redis.exp_bad_key, ("I6",)),
    Experiment("unknown-model", "stack", serving.exp_unknown_model, ("I3",)),
    Experiment("malformed-body", "stack", serving.exp_malformed_body, ("I4",)),
    Experiment("oversized-body", "stack", serving.exp_oversized_body, ("I5",)),
    Experiment("lone-surrogate-at-gateway", "stack", serving.exp_surrogate_gateway, ("I1",)),
    Experiment("lone-surrogate-at-worker", "stack", serving.exp_surrogate_worker, ("I1",)),
    Experiment("corrupt-adapter-direct-load", "stack", serving.exp_corrupt_direct_load, ("A2",)),
    Experiment("adapter-load-failed-answered", "stack", serving.exp_adapter_load_failed, ("A2",)),
    Experiment("adapter-overflow-refused", "stack", serving.exp_adapter_overflow, ("A1",)),
    Experiment("bad-request-among-8-streams", "stack", serving.exp_bad_request, ("I2",)),
    Experiment("client-disconnect-mid-stream", "stack", workers.exp_client_disconnect, ("W4",)),
    Experiment("poison-record-and-event", "stack", auth_redis.exp_poison, ("R3",)),
    Experiment("adapter-unloaded-behind-back", "stack", serving.exp_unload, ("A3",)),
    Experiment("redis-flushed", "stack", auth_redis.exp_redis_flushed, ("K2",), breaks=True),
    Experiment("redis-down-fails-closed", "stack", auth_redis.exp_redis_down, ("K1", "R1"), breaks=True),
    Experiment("worker-paused-past-ttl", "stack", workers.exp_paused, ("W2",), breaks=True),
    Experiment("worker-sigterm-drains", "stack", workers.exp_sigterm_drain, ("W1",), breaks=True),
    Experiment("worker-killed-mid-stream", "stack", workers.exp_killed_mid_stream, ("W3",), breaks=True),
    Experiment("crash-looping-worker", "stack", serving.exp_crash_loop, ("W5",)),
    # The small local serve with its embedded Redis; the last one stops it.
    Experiment("embedded-redis-password", "local", local.exp_redis_password, ("L1",)),
    Experiment("embedded-redis-killed", "local", local.exp_redis_killed, ("L1",)),
    Experiment("gateway-killed", "local", local.exp_gateway_killed, ("L1",)),
    Experiment("serve-stopped-leaves-nothing", "local", local.exp_serve_stopped, ("L3",), breaks=True),
    # On their own.
    Experiment("run-interrupted-resumes", "alone", local.exp_run_resumes, ("L2",)),
    Experiment("operator-killed-at-dispatch", "alone", operator.exp_operator_killed, ("L3",)),
)

BY_NAME = {e.name: e for e in EXPERIMENTS}


def uncovered() -> list[str]:
    """Cases no experiment keeps (must be none), and experiments naming a case that does not exist."""
    ids = {c.id for c in CASES}
    kept = {c for e in EXPERIMENTS for c in e.cases}
    return sorted(ids - kept) + sorted(f"{e.name}: {c}" for e in EXPERIMENTS for c in e.cases if c not in ids)
