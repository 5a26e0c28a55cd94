"""Redis over TLS with a private CA (issue 39 item 6; docs/operations/tls.md).

A real redis-server serving TLS only, started with the flags the chart's bundled Redis gets
(``--port 0 --tls-port … --tls-auth-clients optional``), its certificate signed by a CA the test makes.
Every Redis client of the project connects to it with ``rediss://`` and ``$ELASTUNE_REDIS_CA_FILE``: the
control bus (``elastune_common.bus``, redis-py: operator, gateway registry, workers), the workers'
storage channel (redis-py) and the gateway's own RESP client (rate limits). Each refuses a Redis whose
certificate another CA signed, and presents a client certificate to a Redis that requires one."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from tls_certs import CA, Issued

from elastune_common.bus import Bus, BusUnreachable
from elastune_common.servers import Server
from elastune_common.tls import REDIS_CA_FILE_ENV, REDIS_CERT_FILE_ENV, REDIS_KEY_FILE_ENV
from elastune_gateway.server.resp import PipelineClient, RedisUnavailable
from elastune_gateway.server.tls import redis_context
from elastune_worker.comm.channel import ChannelUnavailable, RedisChannel
from real_servers import start_redis, stop


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[CA, CA]:
    """The Redis CA, and another CA that signs an impostor."""
    root = tmp_path_factory.mktemp("pki")
    return CA(root / "redis-ca", "elastune redis CA"), CA(root / "other-ca", "someone else")


def _tls_redis(tmp: Path, ca: CA, leaf: Issued, clients: str = "optional") -> Server:
    """A TLS-only redis-server on a free port (the chart's bundled Redis flags, templates/redis.yaml)."""
    server = start_redis(
        tmp, "--port", "0", "--tls-port", "{port}", "--tls-cert-file", str(leaf.cert),
        "--tls-key-file", str(leaf.key), "--tls-ca-cert-file", str(ca.ca_file), "--tls-auth-clients", clients,
    )  # fmt: skip
    server.url = f"rediss://localhost:{server.port}/0"
    return server


@pytest.fixture(scope="module")
def servers(pki: tuple[CA, CA], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    ca, other = pki
    good = ca.issue("redis", dns=("localhost",))  # not 127.0.0.1: the name check has something to refuse
    impostor = other.issue("impostor", dns=("localhost",), ips=("127.0.0.1",))
    started = {
        "good": _tls_redis(tmp_path_factory.mktemp("redis-tls"), ca, good),
        "impostor": _tls_redis(tmp_path_factory.mktemp("redis-impostor"), other, impostor),
        "mtls": _tls_redis(tmp_path_factory.mktemp("redis-mtls"), ca, good, clients="yes"),
    }
    yield started
    for server in started.values():
        stop(server.proc)


@pytest.fixture
def trust(pki: tuple[CA, CA], monkeypatch: pytest.MonkeyPatch) -> CA:
    monkeypatch.setenv(REDIS_CA_FILE_ENV, str(pki[0].ca_file))
    return pki[0]


def _resp(url: str) -> list[object]:
    async def go() -> list[object]:
        client = PipelineClient(url, 3.0, ssl_context=redis_context(url))
        try:
            return await client.execute([("INCR", "tls-test"), ("PING",)])
        finally:
            await client.close()

    return asyncio.run(go())


def test_every_client_speaks_tls_to_redis_with_the_private_ca(servers: dict[str, Server], trust: CA) -> None:
    url = servers["good"].url
    bus = Bus(url, "tlsns", socket_timeout=3.0)
    try:
        bus.ping()
        assert bus.redis.set("tls-bus", "1") and bus.redis.get("tls-bus") == "1"
    finally:
        bus.close()
    channel = RedisChannel(url, timeout_s=3.0)
    channel.set("tls-grad", b"\x00\x01", 60)
    assert channel.get("tls-grad") == b"\x00\x01"
    assert _resp(url)[1] == "PONG"
    # No plain-text port: the chart's --port 0 leaves only TLS (a redis:// client cannot talk to it).
    plain = redis.Redis.from_url(url.replace("rediss://", "redis://"), socket_timeout=2)
    with pytest.raises(redis.RedisError):
        plain.ping()


def test_a_redis_another_ca_signed_is_refused(servers: dict[str, Server], trust: CA) -> None:
    url = servers["impostor"].url
    with pytest.raises(BusUnreachable, match="certificate verify failed"):
        Bus(url, "tlsns", socket_timeout=3.0).ping()
    with pytest.raises(ChannelUnavailable, match="certificate verify failed"):
        RedisChannel(url, timeout_s=3.0).set("k", b"v", 60)
    with pytest.raises(RedisUnavailable, match="certificate verify failed"):
        _resp(url)


def test_a_name_the_certificate_lacks_is_refused(servers: dict[str, Server], trust: CA) -> None:
    """The right CA, the wrong name: hostname checks stay on."""
    url = servers["good"].url.replace("localhost", "127.0.0.1")  # the same server, a name it lacks
    with pytest.raises(RedisUnavailable, match="certificate verify failed"):
        _resp(url)
    with pytest.raises(BusUnreachable, match="certificate verify failed"):
        Bus(url, "tlsns", socket_timeout=3.0).ping()


def test_client_certificates_for_a_redis_that_requires_them(
    servers: dict[str, Server], trust: CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = servers["mtls"].url
    with pytest.raises(BusUnreachable):
        Bus(url, "tlsns", socket_timeout=3.0).ping()  # no client certificate: Redis ends the handshake
    client = trust.issue("operator-client", dns=("elastune-operator",))
    monkeypatch.setenv(REDIS_CERT_FILE_ENV, str(client.cert))
    monkeypatch.setenv(REDIS_KEY_FILE_ENV, str(client.key))
    bus = Bus(url, "tlsns", socket_timeout=3.0)
    try:
        bus.ping()
    finally:
        bus.close()
    assert _resp(url)[1] == "PONG"


def test_the_charts_readiness_probe_pings_over_tls(servers: dict[str, Server], trust: CA) -> None:
    """templates/redis.yaml's probe: redis-cli --tls --cacert <ca> -p <port> ping, on the pod's loopback."""
    port = str(servers["good"].port)
    probe = ["redis-cli", "--tls", "--cacert", str(trust.ca_file), "-p", port, "ping"]
    assert subprocess.run(probe, capture_output=True, text=True, timeout=10).stdout.strip() == "PONG"
