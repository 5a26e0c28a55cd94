"""A worker credential rewriting another worker's registry record gets none of its traffic (issue 25
item 4, docs/design.md §6), against real processes: a redis-server with the per-role ACL users, a real worker
(tiny Llama) registered with the worker user, the real gateway with the gateway user, the serving control
publishing the pool record with the operator user, and a rogue HTTP server. An attacker holding the
worker credential (the one copied into every WarmPool namespace) rewrites the victim's record to point
at the rogue server, many times a second, while clients keep sending requests through the gateway.

The control plane's list stands in for the Knative backend's (pod name -> pod IP and worker port, from
the API): here the victim's loopback address and the port it bound. The backends' own lists are tested
in test_vouched_endpoints.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")

from elastune_bench.processes import (  # noqa: E402
    ServiceProcess,
    start_gateway,
    start_worker,
    wait_for_endpoints,
)
from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api.warmpool import ServingSpec  # noqa: E402
from elastune_contract.protocol import ServingState, WorkerRecord, WorkerState, vouched_address  # noqa: E402
from elastune_contract.redis_acl import DEFAULT_USERS, ROLES, Role, acl_file  # noqa: E402
from elastune_demo import build as B  # noqa: E402
from elastune_operator.control.serving import ServingControl  # noqa: E402
from real_servers import start_redis, stop  # noqa: E402

NS, POOL, MODEL, VICTIM = "elastune", "p", "tiny-llama", "victim"
PASSWORDS: dict[Role, str] = {r: f"{r}-pw-{i}" for i, r in enumerate(ROLES)}


def url_as(server: Any, role: Role) -> str:
    """The Redis URL with the role's user in it (each process its own credential)."""
    parts = urlsplit(server.url)
    return f"redis://{DEFAULT_USERS[role]}:{PASSWORDS[role]}@{parts.hostname}:{parts.port}{parts.path}"


class Rogue:
    """The attacker's server: answers like a worker and counts what reaches it."""

    def __init__(self) -> None:
        rogue = self
        self.hits = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._send({"status": "ok"})

            def do_POST(self) -> None:
                rogue.hits += 1
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._send(
                    {
                        "id": "cmpl-rogue", "object": "text_completion", "created": 0, "model": MODEL,
                        "choices": [{"index": 0, "text": "rogue", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    }
                )  # fmt: skip

            def _send(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Attacker:
    """Holds the worker credential and keeps the victim's record pointing at the rogue server (the
    victim's heartbeat puts its own address back every second; this writes twenty times as often)."""

    def __init__(self, redis_url: str, rogue_url: str) -> None:
        self.bus = Bus(redis_url, NS)
        self.forged = WorkerRecord(
            id=VICTIM, pool=POOL, model=MODEL, state=WorkerState.READY, url=rogue_url, started_at=time.time(),
            ready_at=time.time(), serving=ServingState(model=MODEL, max_model_len=256),
        )  # fmt: skip
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.bus.publish_worker(self.forged)  # SET of {ns}:worker:victim: the worker user may
            self.writes += 1
            self._stop.wait(0.05)

    def __enter__(self) -> Attacker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.bus.close()


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("vouch-redis")
    (tmp / "users.acl").write_text(acl_file(PASSWORDS, NS))
    server = start_redis(tmp, "--aclfile", str(tmp / "users.acl"))
    yield server
    stop(server.proc)


def wait_registered(bus: Bus, worker: ServiceProcess, timeout: float = 240.0) -> WorkerRecord:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert worker.alive(), worker.log_tail()
        rec = bus.workers().get(worker.name)
        if rec is not None and rec.url and rec.serving is not None and rec.state == WorkerState.READY:
            return rec
        time.sleep(0.3)
    pytest.fail("the victim worker never registered: " + worker.log_tail())


def counter(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_rewritten_worker_record_gets_no_traffic_and_the_vouched_worker_keeps_serving(
    acl_redis: Any, tmp_path: Path
) -> None:
    model_path = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    operator = Bus(url_as(acl_redis, "operator"), NS)
    rogue = Rogue()
    procs: list[ServiceProcess] = []
    try:
        victim = start_worker(
            url_as(acl_redis, "worker"), NS, VICTIM, model_path, MODEL, tmp_path,
            "--kv-cache-tokens", "4096", "--max-model-len", "256", pool=POOL, wait=False,
        )  # fmt: skip
        procs.append(victim)
        own = wait_registered(operator, victim)
        port = urlsplit(own.url).port
        assert port is not None
        # The control plane: the pool record lists the pool's one worker at the address it knows (the
        # backends key their lists by pool id, namespace/name).
        control = ServingControl(
            operator,
            vouched=lambda: {f"default/{POOL}": {VICTIM: vouched_address("127.0.0.1", port)}},
        )
        control.add_pool(POOL, MODEL, ServingSpec())
        control.tick({})
        gateway = start_gateway(url_as(acl_redis, "gateway"), NS, tmp_path, "--failure-cooldown", "1")
        procs.append(gateway)
        wait_for_endpoints(gateway.url, 1)
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        with Attacker(url_as(acl_redis, "worker"), rogue.url) as attacker:
            time.sleep(1.0)  # a few of the gateway's registry reads see the forged record
            texts = []
            for i in range(12):
                out = client.completions.create(model=MODEL, prompt=f"{i} km", max_tokens=2, temperature=0)
                texts.append(out.choices[0].text)
                time.sleep(0.1)
            assert attacker.writes > 20
        assert rogue.hits == 0, f"{rogue.hits} request(s) went to the rogue server"
        assert "rogue" not in texts and len(texts) == 12
        metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        assert counter(metrics, "elastune_gateway_unvouched_records_total", reason="address") >= 1
        # The victim's next heartbeat puts its own address back: it serves on, vouched.
        time.sleep(1.5)
        assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).usage.completion_tokens
        assert rogue.hits == 0 and gateway.alive() and victim.alive()
    finally:
        for p in reversed(procs):
            p.stop()
        rogue.close()
        operator.close()
