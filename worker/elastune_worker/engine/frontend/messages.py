"""The typed messages between the engine's front end (``streams.RequestStreams``: the HTTP API's side)
and the engine loop (``engine_loop.EngineLoop``), across a thread or a process boundary: vLLM's
``EngineCoreRequest`` + ``EngineCoreRequestType``. Every message pickles (the process sends them over a
pipe); the loop applies the front end's messages and answers with the engine's.

Front end -> engine: ``AddRequest`` | ``AbortRequest`` | ``EngineCall`` | ``Shutdown``.
Engine -> front end: ``StepOutputs`` | ``StatsUpdate`` | ``RequestRefused`` | ``RequestErrored`` |
``CallReply`` (and, once, ``EngineReady`` | ``EngineStartFailed`` from an engine process).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from elastune_worker.engine.core.adapter_ref import AdapterRef
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams

if TYPE_CHECKING:
    from elastune_contract.protocol import ServingCost
    from elastune_worker.engine.llm_engine import EngineStats


class EngineRequestType(enum.Enum):
    """The kinds of message the front end sends the engine."""

    ADD = "add"
    ABORT = "abort"
    CALL = "call"
    SHUTDOWN = "shutdown"


class EngineOp(enum.Enum):
    """What an ``EngineCall`` runs on the engine between two steps (``engine_loop.engine_call``)."""

    LOAD_LORA = "load_lora"
    """arg: (name, path); returns the adapter's ``AdapterInfo``."""
    UNLOAD_LORA = "unload_lora"
    """arg: the adapter's name."""
    COSERVE_START = "coserve_start"
    """arg: a ``CoServeRequest``; returns its first progress (raises ``CoServeRefused``)."""
    COSERVE_POLL = "coserve_poll"
    COSERVE_FINISH = "coserve_finish"
    """arg: the artifact directory; returns the task's result."""
    COSERVE_STOP = "coserve_stop"


# -- front end -> engine -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    """A request to generate for (vLLM's ``EngineCoreRequest``)."""

    type: ClassVar[EngineRequestType] = EngineRequestType.ADD
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    priority: int = 0
    extra_key: str | None = None
    """Keeps this request's prefix-cache blocks apart from others' with the same tokens."""
    adapter: AdapterRef | None = None
    """The LoRA adapter or soft prompt it is served with (resolved from the served name at the API)."""
    tenant: str = ""
    """Whose request it is (the gateway's API key): what the ``fair`` queue policy shares across."""


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request and free its KV blocks (its caller went away)."""

    type: ClassVar[EngineRequestType] = EngineRequestType.ABORT
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Run ``op`` on the engine between steps; the answer is a ``CallReply`` with the same ``call_id``."""

    type: ClassVar[EngineRequestType] = EngineRequestType.CALL
    call_id: str
    op: EngineOp
    arg: Any = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The loop returns."""

    type: ClassVar[EngineRequestType] = EngineRequestType.SHUTDOWN


EngineInput = AddRequest | AbortRequest | EngineCall | Shutdown


# -- engine -> front end -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One step's outputs, one per request it advanced, and the engine's stats after it."""

    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class StatsUpdate:
    """The engine's stats while it is idle (the last aborts and finishes show in the metrics)."""

    stats: EngineStats


@dataclass(frozen=True, slots=True)
class RequestRefused:
    """The engine could not take the request (bad input, an adapter it cannot serve): the caller's 4xx."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class RequestErrored:
    """The engine failed while it ran the request (a step failed): the caller's 5xx."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class CallReply:
    """An ``EngineCall``'s result or exception, and the stats after it (the caller sees the change)."""

    call_id: str
    result: Any
    error: BaseException | None
    stats: EngineStats


EngineOutput = StepOutputs | StatsUpdate | RequestRefused | RequestErrored | CallReply


@dataclass(frozen=True, slots=True)
class EngineReady:
    """An engine process started: what its front end serves from."""

    max_model_len: int
    vocab_size: int
    cost: ServingCost
    cpus: tuple[int, ...] | None
    """The CPUs it is bound to, if it was bound."""
    threads: int
    """Its torch threads."""


@dataclass(frozen=True, slots=True)
class EngineStartFailed:
    message: str
