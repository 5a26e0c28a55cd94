"""All-reduce (mean) over a storage channel: LambdaML's scatter-reduce, for numpy float32 gradients.

One call of ``allreduce_mean(step, array)`` on each of the ``world`` workers of a job:

1. split the flat array into ``world`` contiguous chunks (``np.array_split`` sizes);
2. worker ``w`` uploads its slice of every chunk ``i != w`` to ``elastune:{job}:{step}:grad:{w}:{i}``;
3. worker ``i`` owns chunk ``i``: it polls until the other ``world - 1`` contributions exist, reduces
   them and uploads the mean to ``elastune:{job}:{step}:merged:{i}``, then deletes the grad keys it read;
4. every worker polls the merged chunks of the others and concatenates.

Design points:

* A worker never uploads its own contribution to the chunk it owns (it has it in memory), which saves
  ``1/world`` of the traffic; empty chunks (array shorter than ``world``) are never stored at all.
* Determinism: the owner accumulates in float64 in worker order 0..world-1, divides by ``world`` and
  rounds once to float32. Every worker receives the owner's bytes, so the result is bit-for-bit identical
  on all workers, and reproducible across runs.
* Stale data: keys carry job, step and worker, and every payload has a header (kind, world, source,
  chunk, step, total length, chunk length) that must match what the reader expects; a mismatching value
  (e.g. left by an earlier incarnation with another world size) is ignored and reported on timeout.
  Steps must increase on each instance. Identical-looking data from an earlier *attempt* of the same job
  and step cannot be told apart, so after a CollectiveTimeout the job must regroup under a new ``job``
  key (e.g. ``{uid}-g{generation}``) rather than retry the step.
* Cleanup without a barrier: when worker ``i`` finishes step ``s`` every worker has uploaded its step-``s``
  gradients, so all of them are done reading step ``s-1``; worker ``i`` then deletes its step-``s-1``
  merged key. The last step's merged keys, and anything a crashed worker leaves, expire by TTL.
"""

from __future__ import annotations

import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from elastune_worker.comm.channel import StorageChannel

__all__ = [
    "DEFAULT_TTL_S",
    "CollectiveTimeout",
    "StorageAllReduce",
    "chunk_bounds",
    "grad_key",
    "merged_key",
]

DEFAULT_TTL_S = 600
_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")  # no ':' so keys split unambiguously

_GRAD, _MERGED = 0, 1
_MAGIC = b"ELAR"
# magic, kind, world, src, chunk, step, total length, chunk length
_HEADER = struct.Struct("<4sBIIIQQQ")
_F32 = np.dtype("<f4")  # fixed byte order on the wire


ABORT_CHECK_S = 0.25


class CollectiveAborted(RuntimeError):
    """``should_abort`` returned True while waiting for peers."""


class CollectiveTimeout(TimeoutError):
    """A collective did not complete in time; names what was missing so the failing peer is obvious."""

    def __init__(
        self,
        message: str,
        *,
        job: str,
        step: int,
        phase: str,
        missing_workers: list[int],
        missing_chunks: list[int],
    ) -> None:
        super().__init__(message)
        self.job = job
        self.step = step
        self.phase = phase
        self.missing_workers = missing_workers
        self.missing_chunks = missing_chunks


def grad_key(job: str, step: int, src: int, chunk: int) -> str:
    return f"elastune:{job}:{step}:grad:{src}:{chunk}"


def merged_key(job: str, step: int, chunk: int) -> str:
    return f"elastune:{job}:{step}:merged:{chunk}"


def chunk_bounds(n: int, world: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each worker's chunk; the first ``n % world`` chunks are one longer."""
    base, extra = divmod(n, world)
    bounds = []
    start = 0
    for i in range(world):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class _Expect:
    kind: int
    src: int
    chunk: int
    count: int


def _encode(kind: int, world: int, src: int, chunk: int, step: int, n: int, data: np.ndarray) -> bytes:
    header = _HEADER.pack(_MAGIC, kind, world, src, chunk, step, n, data.size)
    return header + data.astype(_F32, copy=False).tobytes()


def _decode(raw: bytes, exp: _Expect, world: int, step: int, n: int) -> np.ndarray | str:
    """The chunk, or a reason why ``raw`` is not the payload we wait for."""
    if len(raw) < _HEADER.size:
        return f"payload of {len(raw)} bytes is shorter than the header"
    magic, kind, h_world, src, chunk, h_step, h_n, count = _HEADER.unpack_from(raw)
    got = (magic, kind, h_world, src, chunk, h_step, h_n, count)
    want = (_MAGIC, exp.kind, world, exp.src, exp.chunk, step, n, exp.count)
    if got != want:
        fields = ("magic", "kind", "world", "src", "chunk", "step", "length", "chunk_length")
        pairs = zip(fields, got, want, strict=True)
        diff = ", ".join(f"{f}={g!r} (expected {w!r})" for f, g, w in pairs if g != w)
        return f"header mismatch: {diff}"
    if len(raw) != _HEADER.size + 4 * count:
        return f"payload of {len(raw)} bytes does not hold {count} float32 values"
    return np.frombuffer(raw, dtype=_F32, count=count, offset=_HEADER.size)


class StorageAllReduce:
    """Mean all-reduce of float32 arrays among the ``world`` workers of ``job`` over a storage channel.

    Each worker process creates one instance (with its own channel) and calls ``allreduce_mean`` once
    per step with the same ``step`` and the same array length as its peers.
    """

    def __init__(
        self,
        channel: StorageChannel,
        job: str,
        worker: int,
        world: int,
        timeout_s: float = 30.0,
        poll_s: float = 0.002,
        ttl_s: int = DEFAULT_TTL_S,
        should_abort: Callable[[], bool] | None = None,
    ) -> None:
        if not _JOB_RE.match(job):
            raise ValueError(f"job {job!r} must match {_JOB_RE.pattern} (no ':' or whitespace)")
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if not 0 <= worker < world:
            raise ValueError(f"worker must be in [0, {world}), got {worker}")
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"timeout_s and poll_s must be positive, got {timeout_s}, {poll_s}")
        if ttl_s <= timeout_s:
            # Keys must outlive the slowest legitimate wait or a straggler would find them expired.
            raise ValueError(f"ttl_s ({ttl_s}) must exceed timeout_s ({timeout_s})")
        self.channel = channel
        self.job = job
        self.worker = worker
        self.world = world
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.ttl_s = int(ttl_s)
        self.should_abort = should_abort
        """Checked about every ``ABORT_CHECK_S`` while waiting for peers: a cancelled attempt (job deleted,
        a peer lost) stops at once instead of waiting out the timeout."""
        self._last_step: int | None = None
        self._stale_merged: str | None = None  # own merged key of the previous step, deleted next step

    def allreduce_mean(self, step: int, array: np.ndarray) -> np.ndarray:
        """Element-wise mean of ``array`` over all workers; a new float32 array of the input's shape."""
        if array.dtype != np.float32:
            raise TypeError(f"allreduce_mean takes float32 arrays, got {array.dtype}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"job {self.job}: step {step} is not after step {self._last_step}; reusing a step could "
                "read that step's leftover keys"
            )
        # Recorded before any I/O: a step that failed half-way must not be retried under the same keys.
        self._last_step = step
        if self.world == 1:
            return array.copy()

        flat = np.ascontiguousarray(array).reshape(-1)
        n = flat.size
        if n == 0:
            # Nothing to exchange, hence no synchronisation either: keep the previous merged key until a
            # step that does synchronise proves every peer has read it.
            return np.empty(array.shape, dtype=np.float32)
        bounds = chunk_bounds(n, self.world)
        me = self.worker
        deadline = time.monotonic() + self.timeout_s

        # 1. scatter: my slice of every other non-empty chunk
        uploads = {
            grad_key(self.job, step, me, i): _encode(_GRAD, self.world, me, i, step, n, flat[a:b])
            for i, (a, b) in enumerate(bounds)
            if i != me and b > a
        }
        self.channel.set_many(uploads, self.ttl_s)

        out = np.empty(n, dtype=np.float32)
        a_me, b_me = bounds[me]
        if b_me > a_me:
            # 2. reduce the chunk I own
            wanted = {
                grad_key(self.job, step, src, me): _Expect(_GRAD, src, me, b_me - a_me)
                for src in range(self.world)
                if src != me
            }
            got = self._poll(step, n, wanted, deadline, phase="reduce")
            acc = np.zeros(b_me - a_me, dtype=np.float64)
            for src in range(self.world):  # fixed order: the result must not depend on arrival order
                acc += flat[a_me:b_me] if src == me else got[grad_key(self.job, step, src, me)]
            mine = (acc / self.world).astype(np.float32)
            self.channel.set(
                merged_key(self.job, step, me),
                _encode(_MERGED, self.world, me, me, step, n, mine),
                self.ttl_s,
            )
            self.channel.delete(list(wanted))
            out[a_me:b_me] = mine

        # 3. gather the chunks the others own
        wanted = {
            merged_key(self.job, step, i): _Expect(_MERGED, i, i, b - a)
            for i, (a, b) in enumerate(bounds)
            if i != me and b > a
        }
        got = self._poll(step, n, wanted, deadline, phase="gather")
        for key, exp in wanted.items():
            a, b = bounds[exp.chunk]
            out[a:b] = got[key]

        # 4. everyone has read my previous merged chunk (they all reached this step): drop it
        if self._stale_merged is not None:
            self.channel.delete([self._stale_merged])
        self._stale_merged = merged_key(self.job, step, me) if b_me > a_me else None
        return out.reshape(array.shape)

    def _poll(
        self, step: int, n: int, wanted: dict[str, _Expect], deadline: float, *, phase: str
    ) -> dict[str, np.ndarray]:
        got: dict[str, np.ndarray] = {}
        rejected: dict[str, str] = {}
        pending = list(wanted)
        next_abort_check = time.monotonic() + ABORT_CHECK_S
        while pending:
            for key, raw in self.channel.get_many(pending).items():
                value = _decode(raw, wanted[key], self.world, step, n)
                if isinstance(value, str):
                    rejected[key] = value  # keep polling: the rightful writer may still overwrite it
                else:
                    got[key] = value
                    rejected.pop(key, None)
            pending = [k for k in pending if k not in got]
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout(step, phase, [wanted[k] for k in pending], rejected)
            if self.should_abort is not None and now >= next_abort_check:
                next_abort_check = now + ABORT_CHECK_S
                if self.should_abort():
                    raise CollectiveAborted(f"all-reduce of job {self.job!r} step {step} aborted ({phase})")
            time.sleep(self.poll_s)
        return got

    def _timeout(
        self, step: int, phase: str, missing: list[_Expect], rejected: dict[str, str]
    ) -> CollectiveTimeout:
        workers = sorted({e.src for e in missing})
        chunks = sorted({e.chunk for e in missing})
        if phase == "reduce":
            what = f"gradient chunk {self.worker} from worker(s) {workers}"
        else:
            what = f"merged chunk(s) {chunks} from their owner worker(s) {workers}"
        msg = (
            f"all-reduce of job {self.job!r} step {step} timed out after {self.timeout_s:g} s on worker "
            f"{self.worker}/{self.world} ({self.channel.url}): still missing {what}"
        )
        if rejected:
            notes = "; ".join(f"{k}: {r}" for k, r in rejected.items())
            msg += f"; ignored stale or mismatched values: {notes}"
        return CollectiveTimeout(
            msg, job=self.job, step=step, phase=phase, missing_workers=workers, missing_chunks=chunks
        )
