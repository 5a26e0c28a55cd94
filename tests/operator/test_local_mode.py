"""`elastune run` and the control core with real parts: an embedded redis-server, worker processes
(`python -m elastune_worker serve`) loading a tiny GPT-2, PromptTuner scheduling, real training.

The example manifest runs on the default tiny model (the README's main job); the other cases use the
small test model of the worker tests (tests/tiny_test_model.py) through a WarmPool whose model is its
local directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from elastune_common.bus import Bus  # noqa: E402
from elastune_contract.api.resources import parse_resource  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as tiny_tasks  # noqa: E402
from elastune_operator.control.core import ControlCore  # noqa: E402
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig  # noqa: E402
from elastune_operator.local.backend import LocalBackend  # noqa: E402
from elastune_worker.tuning.data import load_dataset, split  # noqa: E402
from elastune_worker.tuning.trainer import evaluate_artifact  # noqa: E402
from local_run import condition, elastune, status_of, tuning_job, warm_pool, write  # noqa: E402
from tiny_test_model import TASK, TEST_SPEC  # noqa: E402 - the small model and task of the worker tests

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")


@pytest.fixture(scope="module")
def small_model() -> Path:
    return tiny_build.ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data")
    task = tiny_tasks.make_task(TASK, n_train=40, n_eval=8, seed=1)
    tiny_tasks.write_jsonl(list(task.train) + list(task.eval), d / "good.jsonl")
    (d / "malformed.jsonl").write_text('{"input": "a", "target": "b"}\n{"input": "c", "target": \n')
    (d / "empty.jsonl").write_text("\n\n")
    return d


# --------------------------------------------------------------------------- the README's main job
def test_example_manifest_runs_improves_and_its_artifact_reproduces_the_metric(tmp_path: Path) -> None:
    """`elastune run -f manifests/tuningjob.yaml`: completes, beats the initial prompt, and the saved
    PEFT artifact re-evaluates to the metric written in status."""
    state = tmp_path / "state"
    proc = elastune(
        "run", "-f", str(ROOT / "manifests" / "tuningjob.yaml"), "--state-dir", str(state), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = status_of(state, "book-author")
    assert condition(st, "Succeeded")["status"] == "True"
    assert st["sloMet"] is True and st["iterations"] >= 1
    initial, final = float(st["initialMetric"]), float(st["currentMetric"])
    assert final > initial, f"tuning did not beat the initial prompt: {initial} -> {final}"
    assert "optimized prompt" in proc.stdout and st["optimizedPrompt"]

    artifact = Path(st["artifactURI"].removeprefix("file://"))
    assert (artifact / "adapter_config.json").is_file() and (artifact / "prompt.txt").is_file()
    # The worker's eval split: spec dataset, 10 % (at most 64) records, seed 0.
    records = load_dataset(str(ROOT / "manifests" / "data" / "extract.jsonl"))
    _, evals = split(records, 0.1, 64, 0)
    again = evaluate_artifact(tiny_build.ensure_tiny_model(), artifact, evals)
    assert round(again, 4) == pytest.approx(final, abs=1e-4)


# --------------------------------------------------------------------------- the Prompt Bank
def test_prompt_bank_picks_the_initial_prompt_or_the_job_falls_back_and_says_why(
    tmp_path: Path, small_model: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastune_worker.bank import bank_dir, build_bank

    cache = tmp_path / "cache"
    monkeypatch.setenv("ELASTUNE_CACHE", str(cache))  # where workers (and bank_dir here) look for banks
    candidates = [
        p for family in ("classify", "case", "arith", "units") for p in tiny_tasks.family_instructions(family)
    ]
    bank = build_bank(small_model, bank_dir(str(small_model.resolve())), candidates, k=3)
    manifest = write(
        tmp_path / "jobs.yaml",
        warm_pool(str(small_model)),
        tuning_job("banked", str(data_dir / "good.jsonl"), model=str(small_model), promptBank="always"),
    )
    state = tmp_path / "state"
    proc = elastune("run", "-f", str(manifest), "--workers", "1", "--state-dir", str(state), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = status_of(state, "banked")
    pb = st["promptBank"]
    assert pb["used"] is True and pb["reason"] == "PromptBankUsed", pb
    assert pb["prompt"] in candidates
    assert 0 < pb["evaluations"] <= bank.k + max(bank.cluster_sizes())  # medoids, then one cluster
    assert float(pb["latencySeconds"]) > 0 and float(pb["score"]) > 0

    # No bank for this LLM: the job starts from its own prompt and its status says why.
    monkeypatch.setenv("ELASTUNE_CACHE", str(tmp_path / "empty-cache"))
    state2 = tmp_path / "state2"
    proc = elastune("run", "-f", str(manifest), "--workers", "1", "--state-dir", str(state2), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pb = status_of(state2, "banked")["promptBank"]
    assert pb["used"] is False and pb["reason"] == "NoFeatures", pb
    assert "initial prompt" in pb["message"]


# --------------------------------------------------------------------------- bad input
def test_bad_datasets_fail_with_reasons_and_the_worker_serves_the_next_job(
    tmp_path: Path, small_model: Path, data_dir: Path
) -> None:
    """Missing file, malformed line, empty file, an output naming a user's directory: each job ends
    Failed with the reason in status and in the CLI output (the user's directory intact); the one worker
    (--workers 1) then runs the good job — it never restarted."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("the user's")
    manifest = write(
        tmp_path / "jobs.yaml",
        warm_pool(str(small_model)),
        # Earlier deadlines are scheduled first (Algorithm 1 sorts by SLO): the bad jobs run first.
        tuning_job("missing", str(data_dir / "nope.jsonl"), model=str(small_model), deadline="6m"),
        tuning_job("malformed", str(data_dir / "malformed.jsonl"), model=str(small_model), deadline="7m"),
        tuning_job("empty", str(data_dir / "empty.jsonl"), model=str(small_model), deadline="8m"),
        tuning_job(
            "victim",
            str(data_dir / "good.jsonl"),
            model=str(small_model),
            deadline="8m30s",
            output={"uri": victim.as_uri()},
        ),
        tuning_job("good", "data/good.jsonl", model=str(small_model), deadline="9m"),
    )
    (tmp_path / "data").symlink_to(data_dir)  # relative dataset path, resolved against the manifest
    state = tmp_path / "state"
    proc = elastune("run", "-f", str(manifest), "--workers", "1", "--state-dir", str(state), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some jobs failed

    expected = {
        "missing": ("DatasetNotFound", "does not exist"),
        "malformed": ("DatasetMalformed", "line 2"),
        "empty": ("DatasetEmpty", "no records"),
        "victim": ("InvalidSpec", "refusing to replace"),
    }
    for name, (reason, words) in expected.items():
        st = status_of(state, name)
        succeeded, failed = condition(st, "Succeeded"), condition(st, "Failed")
        assert succeeded["status"] == "False" and succeeded["reason"] == reason
        assert failed["status"] == "True" and words in failed["message"]
        assert f"TuningJob default/{name}: Failed ({reason})" in proc.stdout
        assert words in proc.stdout
    assert [p.name for p in victim.iterdir()] == ["notes.txt"]
    assert (victim / "notes.txt").read_text() == "the user's"
    assert status_of(state, "victim").get("iterations") in (None, 0), "refused before any training"
    good = status_of(state, "good")
    assert condition(good, "Succeeded")["status"] == "True", good
    assert good["iterations"] == 20
    logs = sorted((state / "logs").glob("*.log"))
    assert len(logs) == 1, f"expected one worker process, got {logs}"


def test_model_that_cannot_load_fails_the_job_with_the_reason(tmp_path: Path, data_dir: Path) -> None:
    missing_model = str(tmp_path / "no-such-model")
    manifest = write(
        tmp_path / "job.yaml",
        warm_pool(missing_model),
        tuning_job("nomodel", str(data_dir / "good.jsonl"), model=missing_model),
    )
    state = tmp_path / "state"
    proc = elastune("run", "-f", str(manifest), "--workers", "1", "--state-dir", str(state), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    st = status_of(state, "nomodel")
    assert condition(st, "Succeeded")["reason"] == "ModelLoadFailed"
    assert "no-such-model" in condition(st, "Failed")["message"]
    assert "ModelLoadFailed" in proc.stdout


def test_unreachable_redis_is_a_clear_cli_error(tmp_path: Path, data_dir: Path) -> None:
    manifest = write(tmp_path / "job.yaml", tuning_job("x", str(data_dir / "good.jsonl")))
    proc = elastune(
        "run", "-f", str(manifest), "--redis-url", "redis://127.0.0.1:1/0", cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in proc.stderr


def test_invalid_manifest_is_rejected_before_anything_starts(tmp_path: Path) -> None:
    bad = tuning_job("bad", "data.jsonl", deadline="0s")
    proc = elastune("run", "-f", str(write(tmp_path / "bad.yaml", bad)), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "spec.deadline" in proc.stderr
    assert not (tmp_path / ".elastune" / "logs").exists() or not any(
        (tmp_path / ".elastune" / "logs").iterdir()
    )


# --------------------------------------------------------------------------- a worker dies mid-job
def test_job_survives_a_killed_worker_and_resumes_from_its_checkpoint(
    tmp_path: Path, small_model: Path, data_dir: Path, redis_server: Any
) -> None:
    """Two GPUs for one job (the profile makes one GPU too slow for the deadline); SIGKILL one worker
    mid-job: the core cancels the attempt, re-schedules, and attempt 2 resumes from the checkpoint."""
    bus = Bus(redis_server.url, namespace=f"kill{time.time_ns()}")
    backend = LocalBackend(tmp_path, redis_server.url, bus.ns)
    pool = PoolConfig(
        "test-pool", str(small_model), max_warm=2, cold_start_seconds=10, seconds_per_iteration=2.0
    )
    settings = CoreSettings(
        cold_capacity=2,
        channel_url=redis_server.url,
        work_dir=tmp_path,
        collective_timeout_s=20,
        checkpoint_every=5,
        progress_every=1,
    )
    core = ControlCore(backend, bus, settings, [pool])
    spec = tuning_job(
        "survivor", str(data_dir / "good.jsonl"), model=str(small_model), deadline="1m40s", iterations=60
    )
    job = parse_resource(spec)
    rec = JobRecord(
        "default/survivor", job.spec, time.time(), str(data_dir / "good.jsonl"), str(tmp_path / "artifact")
    )
    core.submit(rec)
    killed_at = None
    deadline = time.monotonic() + 300
    try:
        while not core.done() and time.monotonic() < deadline:
            core.tick()
            if killed_at is None and (rec.status.iterations or 0) >= 17 and rec.attempt == 1:
                assert rec.status.allocated_gpus == 2, "the deadline should need both GPUs"
                killed_at = rec.status.iterations
                backend.kill(rec.workers[1])
            time.sleep(0.05)
    finally:
        backend.close()
    assert killed_at is not None, "the job never got far enough to kill a worker"
    assert core.done(), rec.status
    assert condition(rec.status.model_dump(by_alias=True), "Succeeded")["status"] == "True", rec.status
    assert rec.status.attempts == 2 and rec.status.iterations == 60
    # Attempt 2 resumed from the newest checkpoint before the kill: at most checkpoint_every steps repeated.
    assert rec.resumed_from[0] == 0 and len(rec.resumed_from) == 2
    resumed = rec.resumed_from[1]
    assert resumed % settings.checkpoint_every == 0
    # Workers step in lockstep, so the survivor's last reported step is where the attempt stopped.
    reached = max(
        e.iterations or 0 for _, e in bus.events(rec.key) if e.attempt == 1 and e.type == "progress"
    )
    assert reached >= killed_at
    assert 0 <= reached - resumed <= settings.checkpoint_every
    metrics = json.loads((tmp_path / "artifact" / "metrics.json").read_text())
    assert metrics["iterations"] == 60
    assert (tmp_path / "artifact" / "prompt.txt").read_text()
