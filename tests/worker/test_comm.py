"""Storage-channel all-reduce against real Redis and Memcached servers (fixtures in conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pymemcache.client.base import Client as MemcacheClient
from pymemcache.exceptions import MemcacheError

from elastune_worker.comm import (
    ChannelUnavailable,
    CollectiveTimeout,
    MemcachedChannel,
    StorageAllReduce,
    chunk_bounds,
    grad_key,
    make_channel,
    merged_key,
)
from elastune_worker.comm.allreduce import _GRAD, _MERGED, _encode

# One worker process: argv = URL JOB WORKER WORLD STEPS DIR; reads DIR/in-{w}-{s}.npy, writes out-{w}-{s}.npy.
CHILD = """
import sys
from pathlib import Path

import numpy as np

from elastune_worker.comm import StorageAllReduce, make_channel

url, job, worker, world, steps, folder = sys.argv[1:]
worker, world, folder = int(worker), int(world), Path(folder)
channel = make_channel(url)
ar = StorageAllReduce(channel, job, worker, world, timeout_s=15.0)
for step in range(int(steps)):
    grad = np.load(folder / f"in-{worker}-{step}.npy")
    np.save(folder / f"out-{worker}-{step}.npy", ar.allreduce_mean(step, grad))
channel.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_job() -> str:
    # Servers are shared by the session: a fresh job name keeps the tests' keys apart.
    return f"test-{uuid.uuid4().hex[:12]}"


def contribution(worker: int, step: int, n: int) -> np.ndarray:
    rng = np.random.default_rng([17, worker, step])
    return (rng.standard_normal(n) * (worker + 1) + step).astype(np.float32)


def reference_mean(arrays: list[np.ndarray]) -> np.ndarray:
    """The documented reduction: float64 sum in worker order, one division, one rounding to float32."""
    acc = np.zeros(arrays[0].shape, dtype=np.float64)
    for a in arrays:
        acc += a
    return (acc / len(arrays)).astype(np.float32)


def run_threads(
    url: str, job: str, world: int, body: Callable[[StorageAllReduce], object], **kwargs: object
) -> list[object]:
    """Run ``body`` for every worker in its own thread with its own channel; exceptions are returned."""

    def one(worker: int) -> object:
        channel = make_channel(url)
        try:
            return body(StorageAllReduce(channel, job, worker, world, **kwargs))  # type: ignore[arg-type]
        except Exception as exc:
            return exc
        finally:
            channel.close()

    with ThreadPoolExecutor(max_workers=world) as pool:
        return list(pool.map(one, range(world)))


# ------------------------------------------------------------------------------------- all-reduce


@pytest.mark.parametrize("world", [2, 4])
def test_worker_processes_get_the_exact_mean_for_consecutive_steps(
    backend, world: int, tmp_path: Path, keys_of
):
    job, steps, n = new_job(), 3, 10_007  # n not divisible by 4: uneven chunks
    for w in range(world):
        for s in range(steps):
            np.save(tmp_path / f"in-{w}-{s}.npy", contribution(w, s, n))
    argv = [sys.executable, "-c", CHILD, backend.url, job]
    procs = [
        subprocess.Popen(
            [*argv, str(w), str(world), str(steps), str(tmp_path)], stderr=subprocess.PIPE, text=True
        )
        for w in range(world)
    ]
    try:
        errors = [p.communicate(timeout=30)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, "\n".join(errors)

    for s in range(steps):
        expected = reference_mean([contribution(w, s, n) for w in range(world)])
        outs = [np.load(tmp_path / f"out-{w}-{s}.npy") for w in range(world)]
        for out in outs:
            assert out.dtype == np.float32
            np.testing.assert_array_equal(out, expected)
            assert out.tobytes() == outs[0].tobytes()  # bit-for-bit identical on every worker

    # Exact look-ups, then a scan for anything else left behind.
    channel = make_channel(backend.url)
    try:
        grads = [grad_key(job, s, src, i) for s in range(steps) for src in range(world) for i in range(world)]
        old_merged = [merged_key(job, s, i) for s in range(steps - 1) for i in range(world)]
        assert channel.get_many(grads + old_merged) == {}
    finally:
        channel.close()
    left = keys_of(backend, f"elastune:{job}:")
    assert set(left) <= {merged_key(job, steps - 1, i) for i in range(world)}, left


def test_world_of_one_never_touches_the_server():
    class Untouchable:
        url = "none://"

        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"world=1 must not use the channel (called {name})")

    ar = StorageAllReduce(Untouchable(), "solo", 0, 1)  # type: ignore[arg-type]
    grad = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = ar.allreduce_mean(0, grad)
    np.testing.assert_array_equal(out, grad)
    assert out is not grad and out.shape == (2, 3)


@pytest.mark.parametrize("n", [0, 1, 3, 5])
def test_arrays_shorter_than_world_and_other_shapes(backend, n: int):
    world, job = 4, new_job()

    def body(ar: StorageAllReduce) -> list[np.ndarray]:
        # 2-D input on the second step: the result keeps the caller's shape
        return [
            ar.allreduce_mean(0, contribution(ar.worker, 0, n)),
            ar.allreduce_mean(1, contribution(ar.worker, 1, 2 * n).reshape(2, n)),
        ]

    results = run_threads(backend.url, job, world, body, timeout_s=10.0)
    for res in results:
        assert isinstance(res, list), res
        np.testing.assert_array_equal(res[0], reference_mean([contribution(w, 0, n) for w in range(world)]))
        want = reference_mean([contribution(w, 1, 2 * n) for w in range(world)]).reshape(2, n)
        assert res[1].shape == (2, n)
        np.testing.assert_array_equal(res[1], want)


def test_chunk_bounds_cover_the_array_and_allow_empty_chunks():
    assert chunk_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]


def test_missing_worker_times_out_naming_it(backend):
    world, job, timeout = 3, new_job(), 0.5

    def body(ar: StorageAllReduce) -> object:
        if ar.worker == 2:
            return None  # worker 2 never shows up
        return ar.allreduce_mean(7, contribution(ar.worker, 7, 30))

    start = time.monotonic()
    results = run_threads(backend.url, job, world, body, timeout_s=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 2.0
    for worker in (0, 1):
        err = results[worker]
        assert isinstance(err, CollectiveTimeout), err
        assert err.job == job and err.step == 7 and err.missing_workers == [2]
        assert "worker(s) [2]" in str(err) and job in str(err) and "step 7" in str(err)


def test_stale_keys_of_other_steps_and_jobs_never_leak(backend):
    world, job, other, n, step = 2, new_job(), new_job(), 101, 5
    bounds = chunk_bounds(n, world)
    garbage = np.full(n, 1e6, dtype=np.float32)
    seed: dict[str, bytes] = {}
    # Well-formed payloads with the right shapes, under the previous step and under another job.
    for j, s in ((job, step - 1), (other, step), (other, step - 1)):
        for i, (a, b) in enumerate(bounds):
            seed[merged_key(j, s, i)] = _encode(_MERGED, world, i, i, s, n, garbage[a:b])
            for src in range(world):
                seed[grad_key(j, s, src, i)] = _encode(_GRAD, world, src, i, s, n, garbage[a:b])
    channel = make_channel(backend.url)
    try:
        channel.set_many(seed, 60)
        results = run_threads(
            backend.url, job, world, lambda ar: ar.allreduce_mean(step, contribution(ar.worker, step, n))
        )
        want = reference_mean([contribution(w, step, n) for w in range(world)])
        for res in results:
            np.testing.assert_array_equal(res, want)
        # Other jobs' keys are not ours to delete.
        assert set(channel.get_many([k for k in seed if other in k])) == {k for k in seed if other in k}
    finally:
        channel.delete(seed)
        channel.close()


def test_mismatched_payload_is_ignored_and_reported(backend):
    # A leftover from an incarnation of the job with world=3 sits under the key worker 1 will write.
    job, n = new_job(), 12
    stale = _encode(_GRAD, 3, 1, 0, 0, n, np.zeros(4, dtype=np.float32))
    channel = make_channel(backend.url)
    try:
        channel.set(grad_key(job, 0, 1, 0), stale, 60)
        ar = StorageAllReduce(channel, job, 0, 2, timeout_s=0.3)
        with pytest.raises(CollectiveTimeout, match=r"header mismatch: world=3 \(expected 2\)") as info:
            ar.allreduce_mean(0, contribution(0, 0, n))
        assert info.value.missing_workers == [1]
        with pytest.raises(ValueError, match="not after step 0"):  # a failed step is not retried
            ar.allreduce_mean(0, contribution(0, 0, n))
    finally:
        channel.delete([grad_key(job, 0, 1, 0), grad_key(job, 0, 0, 1)])
        channel.close()


def test_cleanup_leaves_no_grad_keys_and_only_the_last_merged_keys(backend, keys_of):
    world, job, n = 3, new_job(), 50

    def body(ar: StorageAllReduce) -> object:
        for s in (0, 1, 3):  # steps may skip numbers
            ar.allreduce_mean(s, contribution(ar.worker, s, n))
        return None

    assert run_threads(backend.url, job, world, body) == [None] * world
    last = [merged_key(job, 3, i) for i in range(world)]
    channel = make_channel(backend.url)
    try:
        gone = [grad_key(job, s, src, i) for s in (0, 1, 3) for src in range(world) for i in range(world)]
        gone += [merged_key(job, s, i) for s in (0, 1) for i in range(world)]
        assert channel.get_many(gone) == {}
        assert set(channel.get_many(last)) == set(last)  # the last step's keys wait for their TTL
    finally:
        channel.close()
    left = keys_of(backend, f"elastune:{job}:")
    assert set(left) <= set(last), left


def test_allreduce_rejects_bad_arguments(redis_server):
    channel = make_channel(redis_server.url)
    try:
        with pytest.raises(ValueError, match="no ':'"):
            StorageAllReduce(channel, "a:b", 0, 2)
        with pytest.raises(ValueError, match="worker must be in"):
            StorageAllReduce(channel, "job", 2, 2)
        with pytest.raises(ValueError, match="ttl_s"):
            StorageAllReduce(channel, "job", 0, 2, timeout_s=60, ttl_s=30)
        with pytest.raises(TypeError, match="float32"):
            StorageAllReduce(channel, "job", 0, 2).allreduce_mean(0, np.zeros(3))
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------- channels


def test_channel_contract(backend):
    channel = make_channel(backend.url)
    long_key = "elastune:" + "x" * 300 + ":k"  # over memcached's 250-byte key limit
    keys = ["elastune:contract:a", "elastune:contract:b", long_key]
    try:
        channel.set(keys[0], b"alpha", 60)
        channel.set_many({keys[1]: b"", long_key: b"\x00\x01" * 1000}, 60)
        assert channel.get(keys[0]) == b"alpha"
        assert channel.get("elastune:contract:absent") is None
        got = channel.get_many([*keys, "elastune:contract:absent"])
        assert got == {keys[0]: b"alpha", keys[1]: b"", long_key: b"\x00\x01" * 1000}
        channel.delete(keys)
        assert channel.get_many(keys) == {}
        with pytest.raises(ValueError, match="ttl_s"):
            channel.set(keys[0], b"forever", 0)
    finally:
        channel.close()


@pytest.mark.parametrize("limit_args", [["-I", "64k", "-o", "slab_chunk_max=32768"], []])
def test_memcached_splits_values_over_the_item_limit(make_server, keys_of, limit_args: list[str]):
    limit = 64 * 1024 if limit_args else 1024 * 1024  # memcached's default -I
    server = make_server("memcached", *limit_args, "-m", "64")
    raw = MemcacheClient(("127.0.0.1", server.port), default_noreply=False)
    with pytest.raises(MemcacheError, match="too large"):  # the server really enforces the limit
        raw.set("elastune:too-big", b"x" * (limit + 1))

    url = f"{server.url}?max_item_size={limit}" if limit_args else server.url
    channel = make_channel(url)
    assert isinstance(channel, MemcachedChannel) and channel.max_item_size == limit
    big = np.random.default_rng(0).bytes(5 * limit // 2)
    channel.set("elastune:split:v", big, 60)
    assert channel.get("elastune:split:v") == big
    # Stored as a head naming ceil(2.5) = 3 parts, each under the server's limit (or it would refuse them).
    head = raw.get("elastune:split:v")
    assert head is not None and head[:1] == b"\x01" and len(head) < 64
    parts = keys_of(server, "elastune:split:v:part:")
    token = head[13:21].hex()  # tag, part count (4), total length (8), token (8)
    part_keys = [f"elastune:split:v:part:{token}:{p}" for p in range(3)]
    assert set(parts) <= set(part_keys)
    assert b"".join(raw.get_many(part_keys)[k] for k in part_keys) == big
    channel.delete(["elastune:split:v"])
    assert raw.get_many(["elastune:split:v", *part_keys]) == {}

    # An all-reduce whose chunks each span several items.
    world, job = 2, new_job()
    n = world * (3 * limit // 8)  # 4 bytes per value: 1.5 x limit bytes per chunk
    results = run_threads(url, job, world, lambda ar: ar.allreduce_mean(0, contribution(ar.worker, 0, n)))
    want = reference_mean([contribution(w, 0, n) for w in range(world)])
    for res in results:
        np.testing.assert_array_equal(res, want)
    channel.close()
    raw.close()


@pytest.mark.parametrize("scheme", ["redis", "memcached"])
def test_unreachable_server_raises_channel_unavailable_naming_the_url(scheme: str):
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")
    with pytest.raises(ChannelUnavailable, match=f"storage channel {url} is unavailable"):
        make_channel(url)


def test_unavailable_message_redacts_the_password():
    port = free_port()
    with pytest.raises(ChannelUnavailable) as info:
        make_channel(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert f"redis://:***@127.0.0.1:{port}/0" in str(info.value) and "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    "url, message",
    [
        ("mongodb://127.0.0.1:27017", "unsupported storage channel scheme 'mongodb'"),
        ("127.0.0.1:6379", "unsupported storage channel scheme"),
        ("memcached://", "needs a host"),
        ("memcached://127.0.0.1:11211?item_size=1", "unknown memcached URL option"),
    ],
)
def test_bad_urls_raise_value_error(url: str, message: str):
    with pytest.raises(ValueError, match=message):
        make_channel(url)


def test_redis_password_from_url_env_or_secret_file(
    make_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    server = make_server("redis", "--requirepass", "pw-123")
    monkeypatch.delenv("ELASTUNE_REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("ELASTUNE_REDIS_PASSWORD_FILE", raising=False)
    with pytest.raises(ChannelUnavailable, match="unavailable"):
        make_channel(server.url)
    make_channel(server.url.replace("redis://", "redis://:pw-123@")).close()
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD", "pw-123")
    make_channel(server.url).close()
    monkeypatch.delenv("ELASTUNE_REDIS_PASSWORD")
    secret = tmp_path / "password"
    secret.write_text("pw-123\n")
    monkeypatch.setenv("ELASTUNE_REDIS_PASSWORD_FILE", str(secret))
    channel = make_channel(server.url)
    channel.set("elastune:auth", b"ok", 10)
    assert channel.get("elastune:auth") == b"ok"
    channel.close()
