"""Fetching a WarmPool's model into the model cache (worker/elastune_worker/model_fetch.py) with the real
clients: huggingface_hub against the hub stand-in (testing/elastune_testing/hub_standin.py, a real
HTTP process, HF_ENDPOINT pointing at it), boto3 against the S3 emulator, a copy from a claim path.
Each failure ends in its vocabulary reason; a second fetch downloads nothing; the fetched directory
loads in the worker and the engine offline."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

import s3_emulator
from elastune_contract.api.constants import S3_SECRETS_ROOT_ENV
from elastune_contract.model_source import FETCHED_MARKER, MODEL_CACHE_ENV, parse_model_source
from elastune_contract.vocabulary import Reason
from elastune_testing import hub_standin
from elastune_worker import model_fetch
from elastune_worker.model_fetch import FetchError, fetch
from tiny_test_model import TEST_SPEC

TOKEN = "hf_standin_good_token"
BUCKET = "elastune-models"


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from elastune_demo.build import ensure_tiny_model

    return ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def hub(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[hub_standin.HubStandIn]:
    work = tmp_path_factory.mktemp("hub")
    # A model of an architecture the engine does not serve: the tiny model's files, config.json a BERT's.
    bert = work / "bert"
    shutil.copytree(tiny_dir, bert)
    cfg = json.loads((bert / "config.json").read_text())
    (bert / "config.json").write_text(
        json.dumps({**cfg, "model_type": "bert", "architectures": ["BertModel"]})
    )
    config = {
        "tokens": [TOKEN],
        "repos": {
            "elastune/tiny": {"revisions": {"main": str(tiny_dir), "v1": str(tiny_dir)}, "private": True},
            "elastune/public-tiny": {"revisions": {"main": str(tiny_dir)}},
            "elastune/bert": {"revisions": {"main": str(bert)}, "private": True},
        },
    }
    server = hub_standin.start(config, work)
    yield server
    server.stop()


@pytest.fixture
def env(hub: hub_standin.HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


def _reason(exc: pytest.ExceptionInfo[FetchError]) -> str:
    return exc.value.reason


def test_an_hf_model_is_fetched_once_and_loads_offline(
    env: None, hub: hub_standin.HubStandIn, tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.reset()
    cache = tmp_path / "cache"
    out = fetch("hf://elastune/tiny@v1", cache, token=TOKEN)
    assert out == cache / parse_model_source("hf://elastune/tiny@v1").cache_dir
    marker = json.loads((out / FETCHED_MARKER).read_text())
    assert marker["source"] == "hf://elastune/tiny@v1" and len(marker["revision"]) == 40
    assert (out / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    assert not (out / ".cache").exists() and not (out / ".hf-cache").exists()
    assert not [p for p in cache.iterdir() if ".partial-" in p.name], "a temp directory was left behind"
    first = hub.requests()["elastune/tiny"]
    assert first.get("get", 0) >= 2, first  # the files were downloaded over HTTP

    # A second pool of the same source: the marker is there, no request reaches the hub.
    assert fetch("hf://elastune/tiny@v1", cache, token=TOKEN) == out
    assert hub.requests()["elastune/tiny"] == first

    # The worker resolves the pool's model name to the fetched directory and loads it offline, and the
    # serving engine's loader accepts it.
    import torch

    from elastune_worker.engine.model_runner.models.loader import load_model as engine_load
    from elastune_worker.server.models import load_model

    monkeypatch.setenv(MODEL_CACHE_ENV, str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("hf://elastune/tiny@v1", device="cpu")
    assert loaded.path == out
    ids = loaded.tokenizer("hello", return_tensors="pt").input_ids
    assert loaded.model(ids).logits.shape[-1] >= loaded.tokenizer.vocab_size
    model, cfg = engine_load(out, torch.device("cpu"), torch.float32)
    assert cfg["model_type"] == "gpt2" and model is not None


def test_a_model_not_fetched_does_not_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastune_worker.server.models import ModelLoadError, resolve_model

    monkeypatch.setenv(MODEL_CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the model cache"):
        resolve_model("hf://elastune/tiny@main")


@pytest.mark.parametrize(
    ("source", "token", "reason"),
    [
        ("hf://elastune/tiny", "hf_not_a_token_the_hub_knows", Reason.MODEL_ACCESS_DENIED),
        ("hf://elastune/missing", TOKEN, Reason.MODEL_NOT_FOUND),
        ("hf://elastune/tiny", None, Reason.MODEL_NOT_FOUND),  # private: the hub hides it from anonymous
        ("hf://elastune/tiny@no-such-branch", TOKEN, Reason.MODEL_REVISION_NOT_FOUND),
        ("hf://elastune/bert", TOKEN, Reason.MODEL_UNSUPPORTED),
    ],
    ids=["bad-token", "missing-repo", "private-without-token", "wrong-revision", "unsupported"],
)
def test_hf_failures_have_their_reason_and_leave_nothing(
    env: None, tmp_path: Path, source: str, token: str | None, reason: str
) -> None:
    with pytest.raises(FetchError) as exc:
        fetch(source, tmp_path, token=token)
    assert _reason(exc) == reason, str(exc.value)
    assert not any((p / FETCHED_MARKER).exists() for p in tmp_path.iterdir() if p.is_dir())


def test_the_command_writes_reason_and_message_as_the_termination_message(
    hub: hub_standin.HubStandIn, tmp_path: Path
) -> None:
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_wrong", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "elastune_worker.model_fetch", "--source", "hf://elastune/tiny@main",
         "--cache", str(tmp_path / "cache"), "--termination-log", str(log)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert log.read_text().startswith(f"{Reason.MODEL_ACCESS_DENIED}: hf://elastune/tiny@main")
    assert done.stderr.strip().splitlines()[-1] == log.read_text()  # FallbackToLogsOnError reads the same

    env["HF_TOKEN"] = TOKEN
    done = subprocess.run(
        [sys.executable, "-m", "elastune_worker.model_fetch", "--source", "hf://elastune/public-tiny",
         "--cache", str(tmp_path / "cache"), "--termination-log", str(log)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert log.read_text().startswith(f"{Reason.MODEL_FETCHED}: ")


def test_the_check_knows_exactly_the_architectures_the_engine_serves() -> None:
    from elastune_worker.engine.model_runner.models.loader import ARCHITECTURES

    assert set(ARCHITECTURES) == model_fetch.SUPPORTED_MODEL_TYPES


def test_the_fetch_module_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "import elastune_worker.model_fetch, elastune_worker.storage.s3\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- s3:// and pvc:// -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[s3_emulator.S3Emulator]:
    emu = s3_emulator.start(tmp_path_factory.mktemp("s3-emulator") / "moto.log")
    s3 = emu.client()
    s3.create_bucket(Bucket=BUCKET)
    for path in tiny_dir.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"tiny/{path.relative_to(tiny_dir).as_posix()}")
    yield emu
    emu.stop()


@pytest.fixture
def s3_secrets(tmp_path: Path, emulator: s3_emulator.S3Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    root = tmp_path / "secrets"
    emulator.secret_dir(root, "good")
    emulator.secret_dir(root, "wrong", AWS_ACCESS_KEY_ID="AKIAIOSFODNN7WRONGKEY", AWS_SECRET_ACCESS_KEY="x")
    monkeypatch.setenv(S3_SECRETS_ROOT_ENV, str(root))


def test_an_s3_model_is_fetched_once(s3_secrets: None, tmp_path: Path, tiny_dir: Path) -> None:
    cache = tmp_path / "cache"
    out = fetch(f"s3://{BUCKET}/tiny", cache, s3_secret="good")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(p.name for p in tiny_dir.iterdir()), FETCHED_MARKER]
    )
    assert (out / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    mtime = (out / FETCHED_MARKER).stat().st_mtime_ns
    # Even with credentials that would now be refused, the cached copy is used: nothing is asked.
    assert fetch(f"s3://{BUCKET}/tiny", cache, s3_secret="wrong") == out
    assert (out / FETCHED_MARKER).stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("source", "secret", "reason"),
    [
        (f"s3://{BUCKET}/tiny", "wrong", Reason.MODEL_ACCESS_DENIED),
        (f"s3://{BUCKET}/tiny", "absent", Reason.MODEL_ACCESS_DENIED),
        (f"s3://{BUCKET}/nothing-here", "good", Reason.MODEL_NOT_FOUND),
        ("s3://no-such-bucket/tiny", "good", Reason.MODEL_NOT_FOUND),
    ],
    ids=["wrong-key", "secret-missing", "empty-prefix", "missing-bucket"],
)
def test_s3_failures_have_their_reason(
    s3_secrets: None, tmp_path: Path, source: str, secret: str, reason: str
) -> None:
    with pytest.raises(FetchError) as exc:
        fetch(source, tmp_path / "cache", s3_secret=secret)
    assert _reason(exc) == reason, str(exc.value)


def test_a_pvc_model_is_copied_from_the_claim(tmp_path: Path, tiny_dir: Path) -> None:
    root = tmp_path / "pvc"
    shutil.copytree(tiny_dir, root / "weights" / "models" / "tiny")
    out = fetch("pvc://weights/models/tiny", tmp_path / "cache", pvc_root=root)
    assert (out / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()
    with pytest.raises(FetchError) as exc:
        fetch("pvc://weights/models/absent", tmp_path / "cache", pvc_root=root)
    assert _reason(exc) == Reason.MODEL_NOT_FOUND
