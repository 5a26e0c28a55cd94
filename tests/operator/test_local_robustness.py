"""Local mode as robust as the cluster (issue 38 item 5), as a user runs it:

- `elastune serve` protects its embedded Redis with a generated password (any local user could flush it
  or write the API key map before), restarts it when it dies (on the same port, the control plane
  re-asserting its records) and restarts its gateway when that dies (before: the Redis stayed dead, and
  the gateway's exit ended the whole serve, every worker stopped);
- `elastune run` interrupted and run again with the same manifest and state directory resumes the job
  from its newest checkpoint (before: it restarted from iteration 0 under a new id, leaving the old
  checkpoints orphaned, although it printed that they were kept).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from local_run import condition, status_of, tuning_job, warm_pool, write
from operator_site import wait_for
from serve_process import ElastuneServe, processes_under, write_manifests

pytest.importorskip("torch")

from elastune_demo import build as tiny_build
from elastune_demo import tasks as tiny_tasks
from tiny_test_model import TASK, TEST_SPEC

MODEL = "elastune/tiny-llama"


def _procs_under(root: Path, name: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of the processes named ``name`` with a file open under ``root``."""
    return [(pid, cmd) for pid, cmd in processes_under(root) if name in cmd]


def _models(url: str) -> list[str]:
    try:
        r = httpx.get(url + "/v1/models", timeout=2)
    except httpx.HTTPError:
        return []
    return [m["id"] for m in r.json()["data"]] if r.status_code == 200 else []


def _redis_answers(port: int, *args: str) -> str:
    cli = subprocess.run(
        ["redis-cli", "-p", str(port), "--no-auth-warning", *args], capture_output=True, text=True, timeout=10
    )
    return (cli.stdout + cli.stderr).strip()


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc to find processes (Linux)")
def test_serve_guards_and_restarts_its_redis_and_its_gateway(tmp_path: Path) -> None:
    pool = {
        "apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool",
        "metadata": {"name": "tiny-llama", "namespace": "default"},
        "spec": {"model": MODEL, "maxWarmGPUs": 1, "serving": {"minReplicas": 0}},
    }  # fmt: skip
    state = tmp_path / "state"
    serve = ElastuneServe(write_manifests(tmp_path / "manifests", [pool]), state).wait_up()
    try:
        assert MODEL in wait_for("the pool's model listed", lambda: _models(serve.url), 60)
        ((pid, cmd),) = wait_for("the embedded Redis", lambda: _procs_under(state, "redis-server"), 60)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", cmd).group(1))  # type: ignore[union-attr]  # its title
        assert "requirepass" not in cmd  # the password is in a file only its owner reads
        assert "NOAUTH" in _redis_answers(port, "FLUSHALL"), "the embedded Redis took a command without auth"

        os.kill(pid, signal.SIGKILL)
        (_new_pid, _), *_ = wait_for(
            "the embedded Redis restarted",
            lambda: [p for p in _procs_under(state, "redis-server") if p[0] != pid],
            60,
        )
        assert "NOAUTH" in _redis_answers(port, "PING"), "restarted on another port, or without a password"
        # the pool record is re-asserted: the model is listed again (an empty Redis knows none)
        assert MODEL in wait_for("the model listed after the restart", lambda: _models(serve.url), 60)

        (gw_pid, _), *_ = _procs_under(state, "elastune_gateway.server")
        os.kill(gw_pid, signal.SIGKILL)
        wait_for(
            "a new gateway",
            lambda: [p for p in _procs_under(state, "elastune_gateway.server") if p[0] != gw_pid],
            60,
        )
        assert MODEL in wait_for("the gateway answering again", lambda: _models(serve.url), 60)
        assert serve.proc.poll() is None, "the serve ended with its gateway"
    finally:
        out = serve.stop()
    assert "restarting it" in out and "is back" in out, out


def test_run_interrupted_and_run_again_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    model = tiny_build.ensure_tiny_model(spec=TEST_SPEC)
    task = tiny_tasks.make_task(TASK, n_train=40, n_eval=8, seed=1)
    data = tmp_path / "data.jsonl"
    tiny_tasks.write_jsonl(list(task.train) + list(task.eval), data)
    job = tuning_job("resumable", str(data), model=str(model), iterations=400, deadline="30m")
    manifest = write(tmp_path / "job.yaml", warm_pool(str(model)), job)
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "elastune_cli", "run", "-f", str(manifest), "--workers", "1",
           "--state-dir", str(state), "--checkpoint-every", "5"]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ckpts = state / "checkpoints" / "default" / "resumable"
    wait_for("a checkpoint", lambda: list(ckpts.glob("*/ckpt-*.pt")), 300)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode != 0 and "run the same command again to resume" in err, err
    (job_dir,) = [p for p in ckpts.iterdir() if p.is_dir()]  # beside it: its owner marker
    newest = max(job_dir.glob("ckpt-*.pt")).name

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    said = re.search(r"resuming from its checkpoint (ckpt-\d+\.pt)", again.stderr)
    assert said is not None and said.group(1) >= newest, again.stderr[-3000:]
    dirs = [p.name for p in ckpts.iterdir() if p.is_dir()]
    assert dirs == [job_dir.name], "a new id: the old checkpoints orphaned"
    st = status_of(state, "resumable")
    assert condition(st, "Succeeded")["status"] == "True"
