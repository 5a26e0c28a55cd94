"""Prompt tuning on the worker: datasets, metrics, the data-parallel trainer, checkpoints and artifacts.

Runs on CPU with a small variant of the project's tiny GPT-2 (built offline by ``tiny.build`` and cached
like the default one), one torch thread per process so two workers fit on two cores.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as tiny_tasks  # noqa: E402
from elastune_worker.comm import StorageAllReduce, make_channel  # noqa: E402
from elastune_worker.tuning import metrics as M  # noqa: E402
from elastune_worker.tuning.data import DatasetError, load_dataset, split  # noqa: E402
from elastune_worker.tuning.trainer import (  # noqa: E402
    DEFAULT_SEPARATOR,
    MAX_ITERATIONS,
    TARGET_REACHED,
    CheckpointMismatch,
    OutputNotOurs,
    Trainer,
    TuningConfig,
    evaluate_artifact,
    global_batch_indices,
    latest_checkpoint,
    load_artifact,
)
from tiny_test_model import TASK, TEST_SPEC  # noqa: E402 - shared with the operator tests

ROOT = Path(__file__).resolve().parents[2]
# peft 0.21 calls a transformers 5 API that warns about its own deprecation; nothing for us to change.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

INIT_TEXT = tiny_tasks.family_instructions(TASK.family)[0]

# world=2 vs world=1 tolerance (torch.testing.assert_close: |Δ| <= ATOL + RTOL·|expected|). Observed on
# 8 AdamW steps at lr 0.3: max |Δ| ≈ 2e-6 on parameters up to ≈ 2 in size, at most ~40 % of the bound.
RTOL, ATOL = 1e-5, 1e-6


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: deterministic timings and no oversubscription next to worker processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_build.ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def task() -> tiny_tasks.Task:
    return tiny_tasks.make_task(TASK, n_train=64, n_eval=16, seed=3)


@pytest.fixture(scope="module")
def task_files(task: tiny_tasks.Task, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("task")
    return tiny_tasks.write_jsonl(task.train, d / "train.jsonl"), tiny_tasks.write_jsonl(
        task.eval, d / "eval.jsonl"
    )


def small_cfg(**kw: object) -> TuningConfig:
    base: dict[str, object] = {
        "method": "promptTuning",
        "virtual_tokens": 8,
        "init_text": INIT_TEXT,
        "learning_rate": 0.03,
        "optimizer": "adamw",
        "batch_size": 8,
        "max_iterations": 8,
        "eval_every": 1000,
        "checkpoint_every": 1000,
        "max_length": 96,
        "max_new_tokens": 12,
    }
    base.update(kw)
    return TuningConfig(**base)  # type: ignore[arg-type]


def state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / (ATOL + RTOL·|b|), i.e. the share of the tolerance used)."""
    assert a.keys() == b.keys()
    abs_d = max(float((a[k] - b[k]).abs().max()) for k in a)
    share = max(float(((a[k] - b[k]).abs() / (ATOL + RTOL * b[k].abs())).max()) for k in a)
    return abs_d, share


def worker_cmd(
    model_dir: Path, files: tuple[Path, Path], cfg: TuningConfig, out: Path, **kw: object
) -> list[str]:
    argv = [
        sys.executable, "-m", "elastune_worker.tuning",
        "--model-dir", str(model_dir), "--dataset", str(files[0]), "--eval-dataset", str(files[1]),
        "--config", json.dumps(cfg.to_dict()), "--threads", "1",
        "--state-out", str(out / "state.pt"), "--result-out", str(out / "result.json"),
    ]  # fmt: skip
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def worker_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "worker"), str(ROOT / "operator"), env.get("PYTHONPATH", "")]
    )
    return env


# -------------------------------------------------------------------------------------------- data
def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_load_dataset_reads_paths_and_file_uris(tmp_path: Path):
    p = write(
        tmp_path / "d.jsonl", '{"input": "a", "target": "b"}\n\n{"input": "c", "target": "d", "x": 1}\n'
    )
    expected = [{"input": "a", "target": "b"}, {"input": "c", "target": "d"}]
    assert load_dataset(str(p)) == expected
    assert load_dataset(p.as_uri()) == expected
    assert load_dataset(f"file://localhost{p}") == expected


def test_load_dataset_missing_file(tmp_path: Path):
    with pytest.raises(DatasetError) as err:
        load_dataset(str(tmp_path / "nope.jsonl"))
    assert err.value.reason == "DatasetNotFound"
    assert "nope.jsonl" in str(err.value)


@pytest.mark.parametrize(
    ("line3", "what"),
    [
        ('{"input": "x", "target": ', "invalid JSON"),
        ('["x", "y"]', "expected a JSON object"),
        ('{"input": "x"}', "missing key 'target'"),
        ('{"input": 3, "target": "y"}', "'input' must be a string"),
        ('{"input": "x", "target": "  "}', "'target' is empty"),
    ],
)
def test_load_dataset_malformed_line_reports_its_number(tmp_path: Path, line3: str, what: str):
    good = '{"input": "a", "target": "b"}'
    p = write(tmp_path / "d.jsonl", f"{good}\n\n{line3}\n{good}\n")
    with pytest.raises(DatasetError) as err:
        load_dataset(str(p))
    assert err.value.reason == "DatasetMalformed"
    assert err.value.line == 3
    assert "line 3" in str(err.value) and what in str(err.value)


def test_load_dataset_empty(tmp_path: Path):
    with pytest.raises(DatasetError) as err:
        load_dataset(str(write(tmp_path / "d.jsonl", "\n  \n")))
    assert err.value.reason == "DatasetEmpty"


@pytest.mark.parametrize(
    "uri",
    ["s3://bucket/d.jsonl", "http://h/d.jsonl", "https://h/d.jsonl"],  # pvc://: test_dataset_uri.py
)
def test_load_dataset_unsupported_scheme(uri: str):
    with pytest.raises(DatasetError) as err:
        load_dataset(uri)
    assert err.value.reason == "DatasetUnsupportedScheme"
    assert "not implemented yet" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_split_is_deterministic_and_disjoint():
    records = [{"input": str(i), "target": str(i)} for i in range(50)]
    train, evals = split(records, 0.2, 8, seed=1)
    assert len(evals) == 8 and len(train) == 42
    assert {r["input"] for r in train}.isdisjoint(r["input"] for r in evals)
    assert split(records, 0.2, 8, seed=1) == (train, evals)
    assert split(records, 0.2, 8, seed=2)[1] != evals
    assert [int(r["input"]) for r in train] == sorted(int(r["input"]) for r in train)  # order kept
    assert split(records[:2], 0.1, 5, seed=0)[1] != []  # a positive fraction yields >= 1 eval record


# ----------------------------------------------------------------------------------------- metrics
def test_exact_match_normalises_whitespace_only():
    assert M.exact_match("  SELECT  a\n", "SELECT a") == 1.0
    assert M.exact_match("select a", "SELECT a") == 0.0


def test_rouge_l_f1_on_hand_made_examples():
    # LCS("the cat sat on the mat", "the cat on the mat") = 5: P = 5/6, R = 1, F1 = 10/11
    assert M.rouge_l_f1("the cat sat on the mat", "the cat on the mat") == pytest.approx(10 / 11, abs=1e-12)
    assert M.rouge_l_f1("a b c d", "d c b a") == pytest.approx(0.25, abs=1e-12)  # LCS 1
    assert M.rouge_l_f1("x y", "x y") == 1.0
    assert M.rouge_l_f1("x", "y") == 0.0
    assert M.rouge_l_f1("", "") == 1.0 and M.rouge_l_f1("", "a") == 0.0
    assert M.lcs_length("abcbdab", "bdcaba") == 4


def test_bleu4_on_hand_made_examples():
    # p1 = 5/6, p2 = (3+1)/(5+1), p3 = (1+1)/(4+1), p4 = (0+1)/(3+1), equal lengths: no brevity penalty
    assert M.bleu4("the cat sat on the mat", "the cat is on the mat") == pytest.approx(
        (5 / 6 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25, abs=1e-12
    )
    # too short: all precisions 1, brevity penalty exp(1 - 6/2)
    assert M.bleu4("the cat", "the cat sat on the mat") == pytest.approx(math.exp(-2), abs=1e-12)
    assert M.bleu4("a b c d e", "a b c d e") == 1.0
    assert M.bleu4("42", "42") == 1.0 and M.bleu4("41", "42") == 0.0
    assert M.bleu4("the the the", "the cat") == pytest.approx(
        (1 / 3 * 1 / 3 * 1 / 2 * 1 / 1) ** 0.25, abs=1e-12
    )


def test_metric_directions_and_corpus_mean():
    assert M.reached("loss", 0.5, 0.6) and not M.reached("loss", 0.7, 0.6)
    assert M.reached("bleu", 0.6, 0.6) and not M.reached("rougeL", 0.5, 0.6)
    assert M.is_better("loss", 0.1, 0.2) and M.is_better("exactMatch", 0.2, 0.1)
    assert M.corpus_score("accuracy", ["a", "b"], ["a", "c"]) == 0.5
    with pytest.raises(ValueError):
        M.reached("f1", 0.5, 0.5)
    assert set(M.HIGHER_IS_BETTER) == {"loss", "exactMatch", "accuracy", "bleu", "rougeL"}


# ------------------------------------------------------------------------------------------ config
def test_config_from_tuningjob_spec():
    from elastune_contract.api import TuningJobSpec

    spec = TuningJobSpec.model_validate(
        {
            "model": "tiny-gpt2",
            "dataset": "file:///data/train.jsonl",
            "initialPrompt": "Classify the sentiment.",
            "method": "pTuning",
            "termination": {"maxIterations": 50, "target": {"metric": "rougeL", "value": "0.85"}},
            "deadline": "10m",
            "hyperparameters": {
                "batchSize": 4,
                "learningRate": "0.03",
                "optimizer": "sgd",
                "virtualTokens": 12,
            },
        }
    )
    cfg = TuningConfig.from_spec(spec, eval_every=5, seed=7)
    assert (cfg.method, cfg.virtual_tokens, cfg.init_text) == ("pTuning", 12, "Classify the sentiment.")
    assert (cfg.learning_rate, cfg.optimizer, cfg.batch_size, cfg.max_iterations) == (0.03, "sgd", 4, 50)
    assert (cfg.target_metric, cfg.target_value, cfg.metric) == ("rougeL", 0.85, "rougeL")
    assert (cfg.eval_every, cfg.seed) == (5, 7)
    with pytest.raises(ValueError):
        TuningConfig(target_metric="loss")  # a target needs a value


def test_global_batches_are_a_function_of_seed_and_step():
    n, b = 10, 4
    stream = np.concatenate([global_batch_indices(n, b, seed=5, step=s) for s in range(5)])  # 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert not np.array_equal(stream[:10], stream[10:20])  # reshuffled per epoch
    assert np.array_equal(global_batch_indices(n, b, 5, 3), stream[12:16])  # no state: derivable from step
    assert not np.array_equal(global_batch_indices(n, b, 6, 0), stream[:4])
    assert DEFAULT_SEPARATOR == tiny_tasks.SEPARATOR  # the layout the tiny model was pretrained on


# ---------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def tuned(model_dir: Path, task: tiny_tasks.Task) -> tuple[Trainer, float]:
    """One 40-step promptTuning run, with its eval loss before training."""
    cfg = small_cfg(max_iterations=40, eval_every=10, target_metric="rougeL", target_value=1.0)
    trainer = Trainer(model_dir, cfg, task.train, task.eval)
    before = trainer.evaluate("loss")
    trainer.run()
    return trainer, before


def test_single_worker_tuning_lowers_eval_loss(tuned: tuple[Trainer, float]):
    trainer, before = tuned
    result = trainer.result
    assert result is not None
    assert result.iterations == 40 and result.termination_reason == MAX_ITERATIONS
    assert [e["iterations"] for e in result.evaluations] == [10, 20, 30, 40]
    assert [h["step"] for h in result.history] == list(range(40))
    # observed with TEST_SPEC: 2.75 -> 2.16 (classify-00, lr 0.03, 8 virtual tokens)
    assert result.metrics["loss"] < before - 0.4, (before, result.metrics)
    assert 0.0 <= result.metrics["rougeL"] <= 1.0 and result.value == result.metrics["rougeL"]
    assert all(h["seconds"] > 0 and h["sync_seconds"] >= 0 for h in result.history)


@pytest.mark.parametrize("method", ["promptTuning", "prefixTuning", "pTuning"])
def test_every_method_trains(model_dir: Path, task: tiny_tasks.Task, method: str):
    cfg = small_cfg(method=method, max_iterations=4, eval_every=2)
    trainer = Trainer(model_dir, cfg, task.train, task.eval)
    before, start = trainer.trainable_state(), trainer.evaluate("loss")
    result = trainer.run()
    after = trainer.trainable_state()
    assert result.iterations == 4 and [e["iterations"] for e in result.evaluations] == [2, 4]
    assert all(math.isfinite(h["loss"]) for h in result.history)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no trainable parameter moved"
    # observed: 2.75 -> 2.50 (promptTuning), 2.75 -> 2.56 (prefixTuning), 2.92 -> 2.56 (pTuning)
    assert result.metrics["loss"] < start - 0.1, (start, result.evaluations)


def test_prefix_text_init_is_the_texts_key_value_cache(model_dir: Path, task: tiny_tasks.Task):
    """A prefix holding the KV cache of the init text predicts exactly like those text tokens as a soft
    prompt: both start from the same eval loss (checks the layer/key/value/head layout)."""
    prompt = Trainer(model_dir, small_cfg(method="promptTuning"), task.train, task.eval).evaluate("loss")
    prefix = Trainer(model_dir, small_cfg(method="prefixTuning"), task.train, task.eval).evaluate("loss")
    random_prefix = Trainer(
        model_dir, small_cfg(method="prefixTuning", init_text=None), task.train, task.eval
    ).evaluate("loss")
    assert prefix == pytest.approx(prompt, abs=1e-5)
    assert abs(random_prefix - prompt) > 1e-2


def test_target_reached_stops_early(model_dir: Path, task: tiny_tasks.Task, tmp_path: Path):
    start = Trainer(model_dir, small_cfg(), task.train, task.eval).evaluate("loss")
    target = start - 0.5  # observed: 2.75 at start, reached after 20 steps (2.245)
    cfg = small_cfg(
        max_iterations=60, eval_every=2, checkpoint_every=5, target_metric="loss", target_value=target
    )
    result = Trainer(model_dir, cfg, task.train, task.eval, checkpoint_dir=tmp_path).run()
    assert result.termination_reason == TARGET_REACHED
    assert 2 < result.iterations < 60 and result.iterations % 2 == 0
    assert result.value <= target and result.metrics["loss"] == result.value
    assert all(e["value"] > target for e in result.evaluations[:-1])  # stopped at the first hit
    # a restart after the end (e.g. the pod is rescheduled) must not train past the target
    again = Trainer(model_dir, cfg, task.train, task.eval, checkpoint_dir=tmp_path)
    assert again.resumed_from == result.iterations
    rerun = again.run()
    assert (rerun.termination_reason, rerun.iterations, rerun.value) == (
        TARGET_REACHED,
        result.iterations,
        result.value,
    )
    assert len(rerun.history) == result.iterations


# ------------------------------------------------------------------------------------- equivalence
@pytest.fixture(params=["redis", "memcached"])
def channel_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue(f"{request.param}_server").url


def test_two_workers_equal_one_worker(
    model_dir: Path, task: tiny_tasks.Task, task_files: tuple[Path, Path], tmp_path: Path, channel_url: str
):
    # Batch 7 over 2 workers: shards of 4 and 3, so averaging per-shard means would give a different
    # gradient than the batch mean; only the world/B scaling makes them equal.
    cfg = small_cfg(batch_size=7, max_iterations=8)
    job = f"equiv-{uuid.uuid4().hex[:8]}"
    outs = [tmp_path / f"w{w}" for w in range(2)]
    procs = []
    for w, out in enumerate(outs):
        out.mkdir()
        argv = worker_cmd(
            model_dir, task_files, cfg, out, worker=w, world=2, channel=channel_url, job=job, timeout=120
        )
        procs.append(subprocess.Popen(argv, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    single = Trainer(model_dir, cfg, task.train, task.eval)
    single_result = single.run()
    for p in procs:
        _, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr.decode()[-3000:]

    states = [torch.load(out / "state.pt", weights_only=True) for out in outs]
    results = [json.loads((out / "result.json").read_text()) for out in outs]
    for k in states[0]:  # the all-reduce hands both workers the same bytes: same optimizer steps
        assert torch.equal(states[0][k], states[1][k]), k
    assert [h["loss"] for h in results[0]["history"]] == [h["loss"] for h in results[1]["history"]]
    abs_d, share = state_diff(states[0], single.trainable_state())
    print(f"world=2 vs world=1 after 8 steps: max |Δ| {abs_d:.3g}, {share:.0%} of the tolerance")
    for k, v in single.trainable_state().items():
        torch.testing.assert_close(states[0][k], v, rtol=RTOL, atol=ATOL)
    # the all-reduced loss slot is the global batch mean the single worker computes
    np.testing.assert_allclose(
        [h["loss"] for h in results[0]["history"]], [h["loss"] for h in single_result.history], rtol=1e-5
    )
    assert all(h["sync_seconds"] > 0 for h in results[0]["history"])
    for name, hist in (("world=2 worker 0", results[0]["history"]), ("world=1", single_result.history)):
        compute = 1000 * float(np.median([h["seconds"] for h in hist]))
        sync = 1000 * float(np.median([h["sync_seconds"] for h in hist]))
        print(f"{name}: median compute {compute:.1f} ms/step, sync {sync:.1f} ms/step")


def test_allreduce_grads_match_local_in_process(model_dir: Path, task: tiny_tasks.Task, redis_server):
    """world=1 through a real channel is the same computation as without one (bit for bit)."""
    cfg = small_cfg(max_iterations=3)
    ar = StorageAllReduce(make_channel(redis_server.url), f"solo-{uuid.uuid4().hex[:8]}", 0, 1)
    a = Trainer(model_dir, cfg, task.train, task.eval, allreduce=ar)
    b = Trainer(model_dir, cfg, task.train, task.eval)
    a.run(), b.run()
    assert state_diff(a.trainable_state(), b.trainable_state()) == (0.0, 0.0)


# ------------------------------------------------------------------------------------- checkpoints
def test_killed_worker_resumes_from_checkpoint(
    model_dir: Path, task: tiny_tasks.Task, task_files: tuple[Path, Path], tmp_path: Path
):
    k, n = 4, 30
    cfg = small_cfg(max_iterations=n, checkpoint_every=k, eval_every=10)
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "killed"
    out.mkdir()
    proc = subprocess.Popen(
        worker_cmd(model_dir, task_files, cfg, out, checkpoint_dir=ckpt),
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    last_done = 0
    assert proc.stdout is not None
    for line in proc.stdout:  # one JSON line per finished step (printed after its checkpoint)
        last_done = json.loads(line)["iterations"]
        if last_done >= 6:
            proc.send_signal(signal.SIGKILL)  # no chance to clean up: a node failure
            break
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    for line in proc.stdout:  # steps it printed before the signal landed
        last_done = json.loads(line)["iterations"]
    # a write torn by a crash leaves a temp file; it must never be taken for a checkpoint
    (ckpt / ".ckpt-00000099.pt.torn.tmp").write_bytes(b"\x00garbage")
    assert latest_checkpoint(ckpt) is not None and latest_checkpoint(ckpt).name.startswith("ckpt-0000000")

    resumed = Trainer(model_dir, cfg, task.train, task.eval, checkpoint_dir=ckpt)
    assert resumed.resumed_from is not None and resumed.resumed_from % k == 0
    # Checkpoints precede the progress line, so every printed multiple of K is on disk: of the printed
    # steps at most K-1 are repeated, plus possibly one finished but unprinted when the kill landed.
    assert last_done - k < resumed.resumed_from <= last_done + 1
    result = resumed.run()
    steps = [h["step"] for h in result.history]
    assert steps == list(range(n))  # the restored history plus the new steps: every step exactly once
    first_new = next(h["step"] for h in result.history if h["run"] == 1)
    assert first_new == resumed.resumed_from and result.resumed_from == resumed.resumed_from
    assert len(list(ckpt.glob("ckpt-*.pt"))) <= 2  # old checkpoints are pruned

    uninterrupted = Trainer(model_dir, cfg, task.train, task.eval)
    uninterrupted.run()
    abs_d, share = state_diff(resumed.trainable_state(), uninterrupted.trainable_state())
    print(f"resumed vs uninterrupted after {n} steps: max |Δ| {abs_d:.3g}, {share:.0%} of the tolerance")
    for key, v in uninterrupted.trainable_state().items():
        torch.testing.assert_close(resumed.trainable_state()[key], v, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(
        [h["loss"] for h in result.history], [h["loss"] for h in uninterrupted.history], rtol=1e-5
    )


def test_checkpoint_of_other_hyperparameters_is_refused(
    model_dir: Path, task: tiny_tasks.Task, tmp_path: Path
):
    cfg = small_cfg(max_iterations=2, checkpoint_every=1)
    Trainer(model_dir, cfg, task.train, task.eval, checkpoint_dir=tmp_path).run()
    with pytest.raises(CheckpointMismatch):
        Trainer(model_dir, small_cfg(learning_rate=0.1), task.train, task.eval, checkpoint_dir=tmp_path)
    # cadence and termination may change: the run picks up where it was
    more = Trainer(
        model_dir,
        small_cfg(max_iterations=3, checkpoint_every=5),
        task.train,
        task.eval,
        checkpoint_dir=tmp_path,
    )
    assert more.resumed_from == 2 and more.run().iterations == 3


# ---------------------------------------------------------------------------------------- artifact
def test_an_output_directory_the_job_did_not_write_is_never_replaced(
    tuned: tuple[Trainer, float], tmp_path: Path
) -> None:
    """Issue 25: a TuningJob whose output named an existing directory deleted it. The artifact goes
    into a new or empty directory, or replaces an earlier artifact; anything else is refused, intact."""
    trainer, _ = tuned
    victim = tmp_path / "victim"
    (victim / "data").mkdir(parents=True)
    (victim / "data" / "notes.txt").write_text("the user's")
    with pytest.raises(OutputNotOurs, match="not an artifact"):
        trainer.save_artifact(victim)
    assert (victim / "data" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"], "no leftovers beside it"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(OutputNotOurs):
        trainer.save_artifact(a_file)
    assert a_file.read_text() == "x"
    # An empty directory and an earlier artifact are fine: a retried or repeated job replaces its own.
    (tmp_path / "empty").mkdir()
    assert (trainer.save_artifact(tmp_path / "empty") / "metrics.json").exists()
    again = trainer.save_artifact(tmp_path / "empty")
    assert (again / "metrics.json").exists() and not (again / "notes.txt").exists()


def test_artifact_reproduces_reported_metrics(
    tuned: tuple[Trainer, float], model_dir: Path, task: tiny_tasks.Task, tmp_path: Path
):
    trainer, _ = tuned
    out = trainer.save_artifact(tmp_path / "artifact")
    info = json.loads((out / "metrics.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors", "prompt.txt", "metrics.json"} <= {
        p.name for p in out.iterdir()
    }
    assert info["metric"] == "rougeL" and info["iterations"] == 40
    assert len(info["prompt_token_ids"]) == 8
    assert (out / "prompt.txt").read_text() == trainer.tokenizer.decode(info["prompt_token_ids"])

    from peft import PeftModel

    model = load_artifact(model_dir, out)
    assert isinstance(model, PeftModel)
    loss = evaluate_artifact(model_dir, out, task.eval, "loss")
    assert abs(loss - info["metrics"]["loss"]) <= 1e-6, (loss, info["metrics"]["loss"])
    assert evaluate_artifact(model_dir, out, task.eval) == pytest.approx(info["value"], abs=1e-9)
