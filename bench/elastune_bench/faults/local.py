"""Experiments on local mode's own supervision (issue 38 item 5): `elastune serve` guards its embedded
Redis with a password and restarts it and its gateway when they die; stopped, it leaves no process
behind; `elastune run` interrupted and run again resumes from its newest checkpoint under the same id.

These run on a second, small `elastune serve` with its embedded Redis (the main stack's Redis is the
bench's own, so it can keep it down) and no warm worker (nothing here needs one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import redis

from elastune_common.servers import free_port

from .stack import CLI, DATASET, ENV, KEY, MODEL, Outcome, Plan, auth, key_secret, wait_until, write_docs


def processes_under(root: Path, name: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes named ``name`` with a file open under ``root`` (what a serve
    with that state directory started), as a user finds them with lsof."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(root)) for fd in fds):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if name in cmd:
                    found.append((int(pid), cmd))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


class LocalServe:
    """`elastune serve` with its embedded Redis, a pool of no warm worker and one API key."""

    def __init__(self, root: Path) -> None:
        pool = {
            "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
            "metadata": {"name": "tiny-llama", "namespace": "default"},
            "spec": {"model": MODEL, "maxWarmGPUs": 1, "serving": {"minReplicas": 0}},
        }  # fmt: skip
        folder = write_docs(root / "manifests", [pool, key_secret("chaos-valid", KEY)])
        self.state = root / "state"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = root / "serve.log"
        cmd = [*CLI, "serve", "-f", str(folder), "--port", self.url.rsplit(":", 1)[1], "--workers", "1"]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*cmd, "--state-dir", str(self.state)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **ENV}, start_new_session=True,
            )  # fmt: skip

    def models(self) -> list[str]:
        r = httpx.get(self.url + "/v1/models", headers=auth(), timeout=3)
        return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []

    def redis(self) -> tuple[int, int] | None:
        """(pid, port) of the embedded redis-server."""
        for pid, cmd in processes_under(self.state, "redis-server"):
            port = re.search(r"127\.0\.0\.1:(\d+)", cmd)
            if port:
                return pid, int(port.group(1))
        return None

    def gateway(self) -> int | None:
        found = processes_under(self.state, "elastune_gateway.server")
        return found[0][0] if found else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_local(root: Path) -> LocalServe:
    serve = LocalServe(root)
    if not wait_until(lambda: MODEL in serve.models(), 120, 0.3):
        serve.close()
        raise RuntimeError(f"the local serve never listed {MODEL}:\n{serve.log.read_text()[-2000:]}")
    return serve


def _unauthenticated(port: int, *command: str) -> str:
    """What the embedded Redis answers a client without its password."""
    client = redis.Redis(port=port, socket_timeout=3)
    try:
        return str(client.execute_command(*command))
    except redis.RedisError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def _refused(answer: str) -> bool:
    """Redis refused an unauthenticated client (NOAUTH, or redis-py's AuthenticationError at HELLO)."""
    return "NOAUTH" in answer.upper() or answer.startswith("AuthenticationError")


def exp_redis_password(serve: LocalServe, plan: Plan) -> Outcome:
    """Any local user reaching the embedded Redis without its password is refused (it could flush it or
    write the key map); the password is not on any command line."""
    found = serve.redis()
    if found is None:
        return Outcome(False, "no embedded redis-server found under the state directory")
    pid, port = found
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    flush = _unauthenticated(port, "FLUSHALL")
    keys = _unauthenticated(port, "HGETALL", "elastune:api-keys")
    detail = (
        f"embedded Redis on port {port}: FLUSHALL without the password -> {flush[:60]!r}; a read of "
        f"the key map -> {keys[:40]!r}; password on its command line: {'requirepass' in cmdline}"
    )
    held = _refused(flush) and _refused(keys) and "requirepass" not in cmdline
    return Outcome(held and MODEL in serve.models(), detail)


def exp_redis_killed(serve: LocalServe, plan: Plan) -> Outcome:
    """SIGKILL to the embedded Redis: `elastune serve` restarts it on the same port with the same password
    and re-asserts its records (the pool's model is listed again, the key works again)."""
    found = serve.redis()
    if found is None:
        return Outcome(False, "no embedded redis-server found under the state directory")
    pid, port = found
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    new = wait_until(lambda: (r := serve.redis()) is not None and r[0] != pid and r, plan.recover_s, 0.2)
    restarted = time.monotonic() - t0
    listed = wait_until(lambda: MODEL in serve.models(), plan.recover_s, 0.3)
    took = time.monotonic() - t0
    guarded = _refused(_unauthenticated(port, "PING"))
    detail = ("embedded Redis SIGKILLed: "
              + (f"restarted after {restarted:.1f} s on port {new[1]}" if new else "NOT restarted")
              + f", password {'kept' if guarded else 'LOST'}; the model listed with the key again "
              + (f"{took:.1f} s after the kill" if listed else "NOT in time")
              + f"; serve {'alive' if serve.proc.poll() is None else 'EXITED'}")  # fmt: skip
    held = bool(new) and new[1] == port and guarded and bool(listed) and serve.proc.poll() is None
    return Outcome(held, detail)


def exp_gateway_killed(serve: LocalServe, plan: Plan) -> Outcome:
    """SIGKILL to the gateway: `elastune serve` starts a new one (before: its exit ended the serve and
    stopped every worker)."""
    pid = serve.gateway()
    if pid is None:
        return Outcome(False, "no gateway process found under the state directory")
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    new = wait_until(lambda: (g := serve.gateway()) is not None and g != pid, plan.recover_s, 0.2)
    answering = wait_until(lambda: MODEL in serve.models(), plan.recover_s, 0.3)
    took = time.monotonic() - t0
    alive = serve.proc.poll() is None
    detail = ("gateway SIGKILLed: " + ("a new gateway process" if new else "NO new gateway")
              + (f", answering with the key {took:.1f} s after the kill" if answering else ", NOT answering")
              + f"; serve {'alive' if alive else 'EXITED'}")  # fmt: skip
    return Outcome(bool(new) and bool(answering) and alive, detail)


def exp_serve_stopped(serve: LocalServe, plan: Plan) -> Outcome:
    """Ctrl-C to `elastune serve`: it exits 0 and leaves no process of its own behind (Redis, gateway,
    workers)."""
    serve.proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        code: int | None = serve.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - t0
    left = wait_until(lambda: not processes_under(serve.state, ""), 10, 0.2)
    rest = processes_under(serve.state, "")
    detail = (
        f"SIGINT: serve exited {code} after {took:.1f} s; processes left with files under its state "
        f"directory: {[c[:60] for _, c in rest] if not left else 'none'}"
    )
    return Outcome(code == 0 and bool(left), detail)


def _iteration(name: str) -> int:
    return int(re.sub(r"\D", "", name) or 0)


def exp_run_resumes(root: Path, plan: Plan) -> Outcome:
    """`elastune run` interrupted (Ctrl-C) after its first checkpoint and run again with the same manifest
    and state directory: it says it resumes from its newest checkpoint, keeps the job's id (one
    checkpoint folder), and the job ends Succeeded."""
    import yaml

    # The worker finishes its current job after the SIGTERM `elastune run` sends it on Ctrl-C (the tiny
    # model trains tens of iterations a second): the detail says where the first run's training stopped.
    iterations = 60 if plan.quick else 120
    pool = {
        "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "tiny-llama", "namespace": "default"},
        "spec": {"model": MODEL, "maxWarmGPUs": 1},
    }  # fmt: skip
    job = {
        "apiVersion": "elastune.dev/v1alpha1", "kind": "TuningJob",
        "metadata": {"name": "resumable", "namespace": "default"},
        "spec": {"model": MODEL, "dataset": str(DATASET), "termination": {"maxIterations": iterations},
                 "deadline": "30m", "promptBank": "never",
                 "hyperparameters": {"batchSize": 4, "virtualTokens": 8}},
    }  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "job.yaml"
    manifest.write_text(yaml.safe_dump_all([pool, job], sort_keys=False))
    state = root / "state"
    cmd = [
        *CLI,
        "run",
        "-f",
        str(manifest),
        "--workers",
        "1",
        "--state-dir",
        str(state),
        "--checkpoint-every",
        "5",
    ]
    env = {**os.environ, **ENV}
    ckpts = state / "checkpoints" / "default" / "resumable"
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # fmt: skip
    try:
        got = wait_until(lambda: list(ckpts.glob("*/ckpt-*.pt")), 300, 0.2)
        first.send_signal(signal.SIGINT)
        at_signal = max((p.name for p in got or []), key=_iteration, default="none")
        _, err1 = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    if not got:
        return Outcome(False, f"no checkpoint within 300 s: {err1[-300:]!r}")
    dirs = [p for p in ckpts.iterdir() if p.is_dir()]  # one per job id (beside it: its owner file)
    newest = max((p.name for p in ckpts.glob("*/ckpt-*.pt")), key=_iteration)
    t0 = time.monotonic()
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    took = time.monotonic() - t0
    said = re.search(r"resuming from its checkpoint (ckpt-\d+\.pt)", again.stderr)
    ids = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    # The status file: status/<namespace>/<name>.yaml (older: status/tuningjob-<namespace>-<name>.yaml).
    found = sorted((state / "status").rglob("*resumable.yaml"))
    doc = (yaml.safe_load(found[0].read_text()) or {}) if found else {}
    conds = doc.get("status", {}).get("conditions", [])
    succeeded = any(c.get("type") == "Succeeded" and c.get("status") == "True" for c in conds)
    detail = (f"Ctrl-C at {at_signal}, stopped after {newest} of {iterations} iterations (exit "
              f"{first.returncode}, said to re-run: "
              f"{'run the same command again to resume' in err1}); re-run: exit {again.returncode} after "
              f"{took:.0f} s, " + (f"resumed from {said.group(1)}" if said else "did NOT say it resumed")
              + f", checkpoint folders {len(dirs)} -> {len(ids)}, Succeeded {succeeded}")  # fmt: skip
    held = (
        again.returncode == 0
        and said is not None
        and _iteration(said.group(1)) >= _iteration(newest)
        and ids == sorted(d.name for d in dirs)
    )
    return Outcome(held and succeeded, detail)
