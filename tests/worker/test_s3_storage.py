"""s3:// artifacts against a real S3-compatible server process: the S3 emulator (moto_server) on a
loopback port, with credentials enforced (tests/s3_emulator.py).

Round trip of a PEFT-like directory through a mounted Secret's files and through the AWS_* environment,
the download cache (one LIST per repeated load, a replaced artifact downloaded again), and each way it
goes wrong ending in its reason: missing bucket, wrong credentials, missing object, a Secret that is not
there, an endpoint nobody answers on.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

import s3_emulator
from elastune_common.bus import Bus
from elastune_common.servers import Server, free_port
from elastune_contract.api.constants import AMBIENT_CREDENTIALS, S3_CACHE_ENV, S3_SECRETS_ROOT_ENV
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.protocol import PlacedAdapter, ServingState, WorkerRecord, WorkerState
from elastune_contract.vocabulary import PERMANENT_FAILURE_REASONS, Reason
from elastune_operator.control.serving import AdapterRecord, ServingControl
from elastune_worker.server.placement import AdapterSync
from elastune_worker.storage import s3
from serve_process import ElastuneServe, write_manifests

BUCKET = "elastune-artifacts"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3_emulator.S3Emulator]:
    try:
        emu = s3_emulator.start(tmp_path_factory.mktemp("s3-emulator") / "moto.log")
    except RuntimeError as exc:
        pytest.fail(f"the S3 emulator did not start: {exc}")
    emu.client().create_bucket(Bucket=BUCKET)
    yield emu
    emu.stop()


@pytest.fixture
def secrets(tmp_path: Path, emulator: s3_emulator.S3Emulator, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Secrets as their volumes mount them: ``good`` (the emulator's key) and ``wrong`` (a key the
    emulator does not know); the process environment carries no AWS_* at all."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    root = tmp_path / "secrets"
    emulator.secret_dir(root, "good")
    emulator.secret_dir(root, "wrong", AWS_ACCESS_KEY_ID="AKIAIOSFODNN7WRONGKEY", AWS_SECRET_ACCESS_KEY="x")
    monkeypatch.setenv(S3_SECRETS_ROOT_ENV, str(root))
    return root


def peft_like(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (root / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "nested").mkdir()
    (root / "nested" / "tokenizer.json").write_text("{}")
    return root


def files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.startswith(".")
    }


def test_round_trip_through_a_mounted_secret_and_the_cache(
    tmp_path: Path, secrets: Path, emulator: s3_emulator.S3Emulator
) -> None:
    src = peft_like(tmp_path / "adapter")
    url = f"s3://{BUCKET}/adapters/round-trip"
    assert s3.upload(src, url, "good") == url
    keys = sorted(o["Key"] for o in emulator.client().list_objects_v2(Bucket=BUCKET)["Contents"])
    assert keys == [
        "adapters/round-trip/adapter_config.json",
        "adapters/round-trip/adapter_model.safetensors",
        "adapters/round-trip/nested/tokenizer.json",
    ]

    cache = tmp_path / "cache"
    got = s3.download(url, "good", cache)
    assert files(got) == files(src)
    # A repeated load lists the prefix and finds the same content: no second download.
    (got / "seen").write_text("kept")
    assert s3.download(url, "good", cache) == got and (got / "seen").exists()
    # The artifact replaced under the same prefix: its new content, in a new directory.
    emulator.client().put_object(Bucket=BUCKET, Key="adapters/round-trip/nested/tokenizer.json", Body=b"[]")
    again = s3.download(url + "/", "good", cache)
    assert again != got and (again / "nested" / "tokenizer.json").read_bytes() == b"[]"
    assert not got.exists(), "the superseded copy is removed"


def test_the_aws_environment_is_used_when_asked_for(
    tmp_path: Path, emulator: s3_emulator.S3Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`elastune serve` / `elastune run` on a laptop with useAmbientCredentials: the AWS_* variables
    (never without it: tests/security/test_ambient_credentials.py)."""
    for key, value in emulator.secret_keys().items():
        monkeypatch.setenv(key, value)
    url = f"s3://{BUCKET}/env/adapter"
    s3.upload(peft_like(tmp_path / "a"), url, AMBIENT_CREDENTIALS)
    assert files(s3.download(url, AMBIENT_CREDENTIALS, tmp_path / "cache")) == files(tmp_path / "a")


def test_missing_bucket(tmp_path: Path, secrets: Path) -> None:
    url = "s3://no-such-bucket/adapters/x"
    for call in (
        lambda: s3.download(url, "good", tmp_path / "cache"),
        lambda: s3.upload(peft_like(tmp_path / "a"), url, "good"),
        lambda: s3.check_bucket(url, "good"),
    ):
        with pytest.raises(s3.StorageError) as err:
            call()
        assert err.value.reason == Reason.STORAGE_BUCKET_NOT_FOUND, err.value
        assert "no-such-bucket" in str(err.value)


def test_wrong_credentials(tmp_path: Path, secrets: Path, emulator: s3_emulator.S3Emulator) -> None:
    url = f"s3://{BUCKET}/adapters/round-trip"
    s3.upload(peft_like(tmp_path / "a"), url, "good")
    for call in (
        lambda: s3.download(url, "wrong", tmp_path / "cache"),
        lambda: s3.upload(tmp_path / "a", f"s3://{BUCKET}/elsewhere", "wrong"),
        lambda: s3.check_bucket(url, "wrong"),
    ):
        with pytest.raises(s3.StorageError) as err:
            call()
        assert err.value.reason == Reason.STORAGE_ACCESS_DENIED, err.value
    assert not any(o["Key"].startswith("elsewhere") for o in emulator.client().list_objects_v2(
        Bucket=BUCKET)["Contents"])  # fmt: skip


def test_missing_object(tmp_path: Path, secrets: Path) -> None:
    # A prefix with no object under it; "round-trip" must not match "round-trip-2"'s sibling either.
    for url in (f"s3://{BUCKET}/adapters/nothing-here", f"s3://{BUCKET}/adapters/round"):
        with pytest.raises(s3.StorageError) as err:
            s3.download(url, "good", tmp_path / "cache")
        assert err.value.reason == Reason.ARTIFACT_NOT_FOUND and "no object" in str(err.value)


def test_a_secret_that_is_not_mounted(tmp_path: Path, secrets: Path) -> None:
    with pytest.raises(s3.StorageError) as err:
        s3.download(f"s3://{BUCKET}/adapters/round-trip", "not-there", tmp_path / "cache")
    assert err.value.reason == Reason.STORAGE_SECRET_NOT_FOUND and "not-there" in str(err.value)


def test_an_endpoint_nobody_answers(tmp_path: Path, secrets: Path, emulator: s3_emulator.S3Emulator) -> None:
    emulator.secret_dir(secrets, "closed", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(s3.StorageError) as err:
        s3.download(f"s3://{BUCKET}/adapters/round-trip", "closed", tmp_path / "cache")
    assert err.value.reason == Reason.STORAGE_UNREACHABLE
    # The reasons a retry cannot fix end a TuningJob at once; an unreachable endpoint is retried.
    assert Reason.STORAGE_ACCESS_DENIED in PERMANENT_FAILURE_REASONS
    assert Reason.STORAGE_UNREACHABLE not in PERMANENT_FAILURE_REASONS


def test_the_reason_survives_a_process_boundary() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(s3.StorageError(Reason.STORAGE_ACCESS_DENIED, "denied")))
    assert err.reason == Reason.STORAGE_ACCESS_DENIED and str(err) == "denied"


# --------------------------------------------------------------------------- served by a worker engine
class _Placement:
    """The bus as AdapterSync reads it: this worker's placement, as the operator writes it."""

    def __init__(self, placed: dict[str, PlacedAdapter]) -> None:
        self.placed = placed

    def placement(self, worker_id: str) -> dict[str, PlacedAdapter]:
        return self.placed


class _EngineClient:
    """The serving client's adapter calls, straight into an in-process engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def load_lora(self, name: str, path: str) -> Any:
        return self.engine.load_lora(name, path)

    async def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)


@pytest.fixture(scope="module")
def tiny_lora(emulator: s3_emulator.S3Emulator) -> dict[str, Any]:
    pytest.importorskip("torch")
    from elastune_demo import adapters as A
    from elastune_demo import build as B

    base = B.ensure_tiny_model(spec=B.TINY_LLAMA_SPEC)
    local = A.ensure_tiny_adapter(8)
    root = Path(str(local) + "-s3-secrets")
    emulator.secret_dir(root, "good")
    old = os.environ.get(S3_SECRETS_ROOT_ENV)
    os.environ[S3_SECRETS_ROOT_ENV] = str(root)
    try:
        s3.upload(local, f"s3://{BUCKET}/adapters/tiny-r8", "good")
    finally:
        os.environ.pop(S3_SECRETS_ROOT_ENV) if old is None else os.environ.__setitem__(
            S3_SECRETS_ROOT_ENV, old
        )
    return {"base": base, "local": local}


def test_a_lora_adapter_on_s3_is_placed_loaded_and_served(
    tmp_path: Path, secrets: Path, tiny_lora: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placement names the s3:// artifact and only the Secret's name; the worker downloads it into
    its cache and the engine serves it with the same tokens as the local copy of the adapter."""
    from elastune_worker.engine.core.config import EngineConfig
    from elastune_worker.engine.core.sampling import SamplingParams
    from elastune_worker.engine.llm_engine import LLMEngine

    monkeypatch.setenv(S3_CACHE_ENV, str(tmp_path / "cache"))
    url = f"s3://{BUCKET}/adapters/tiny-r8"
    eng = LLMEngine(tiny_lora["base"], EngineConfig(kv_cache_tokens=2048, enable_lora=True, max_loras=2))
    sync = AdapterSync(
        _Placement({"r8-s3": PlacedAdapter(url=url, tier="host", secret="good")}),  # type: ignore[arg-type]
        "w1",
        lambda: _EngineClient(eng),
    )
    sync.sync()
    assert sync.errors == {} and sync.managed == {"r8-s3": url}
    eng.load_lora("r8-local", str(tiny_lora["local"]))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["198 km →", "1907-02-28 →"]
    from_s3 = eng.generate(prompts, greedy, ["r8-s3"] * 2)
    assert from_s3 == eng.generate(prompts, greedy, ["r8-local"] * 2)
    assert from_s3 != eng.generate(prompts, greedy, [None, None]), "the adapter changes the answers"
    # vLLM's lora_path names no credentials: even with an AWS_* environment around, s3:// is refused
    # there (no implicit identity); placed adapters carry their Secret or useAmbientCredentials.
    for key, value in s3_emulator_keys(secrets).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(Exception, match=Reason.STORAGE_CREDENTIALS_UNSET):
        eng.load_lora("r8-api", url)


def s3_emulator_keys(secrets: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in (secrets / "good").iterdir()}


@pytest.mark.parametrize(
    ("url", "secret", "reason"),
    [
        ("s3://no-such-bucket/adapters/tiny-r8", "good", Reason.STORAGE_BUCKET_NOT_FOUND),
        (f"s3://{BUCKET}/adapters/tiny-r8", "wrong", Reason.STORAGE_ACCESS_DENIED),
        (f"s3://{BUCKET}/adapters/no-such-adapter", "good", Reason.ARTIFACT_NOT_FOUND),
    ],
)
def test_a_placed_adapter_that_cannot_be_read_reports_its_reason(
    tmp_path: Path,
    secrets: Path,
    bus: Bus,
    url: str,
    secret: str,
    reason: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the worker publishes (placement_errors / placement_reasons) and the LoRAAdapter's Ready
    condition the control plane makes of it."""
    monkeypatch.setenv(S3_CACHE_ENV, str(tmp_path / "cache"))
    loads: list[str] = []

    class Client:
        async def load_lora(self, name: str, path: str, namespace: str = "") -> None:
            loads.append(path)

    sync = AdapterSync(  # placed under its adapter id, namespace/name
        _Placement({"default/a": PlacedAdapter(url=url, tier="host", secret=secret)}),  # type: ignore[arg-type]
        "w1",
        lambda: Client(),
    )
    sync.sync()
    assert loads == [] and sync.reasons == {"default/a": reason}, sync.errors
    sync.sync()  # not retried at once (every STORAGE_RETRY_SECONDS)
    assert loads == []

    # The control plane: it placed the artifact with the Secret's name only, and makes the worker's
    # report the adapter's Ready=False with that reason.
    control = ServingControl(bus)
    control.add_pool("tiny-llama", MODEL, None)
    spec = {"baseModel": MODEL, "artifactURL": url, "artifactSecret": secret}
    rec = AdapterRecord("default", "a", LoRAAdapterSpec.model_validate(spec))
    control.upsert_adapter(rec)
    control.tick({"w1": _worker({}, {})})
    assert bus.placement("w1") == {"default/a": PlacedAdapter(url=url, tier="host", secret=secret)}
    control.tick({"w1": _worker(sync.errors, sync.reasons)})
    ready = next(c for c in rec.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("False", reason) and "w1: " in ready.message


MODEL = "elastune/tiny-llama"


@pytest.fixture
def bus(redis_server: Server) -> Iterator[Bus]:
    b = Bus(redis_server.url, namespace=f"s3t{time.monotonic_ns()}")
    yield b
    b.close()


def _worker(errors: dict[str, str], reasons: dict[str, str]) -> WorkerRecord:
    serving = ServingState(
        model=MODEL, max_model_len=2048, max_loras=2, placement_errors=errors, placement_reasons=reasons
    )
    return WorkerRecord(
        id="w1", pool="tiny-llama", model=MODEL, state=WorkerState.READY, started_at=0, serving=serving
    )


# --------------------------------------------------------------------------- TuningJob output, pod spec
def test_tuningjobs_with_s3_outputs_in_local_mode(
    tmp_path: Path, emulator: s3_emulator.S3Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`elastune run -f` with Secret manifests beside the jobs: the tuned artifact lands in the bucket
    and status names its s3:// URI; a missing bucket and wrong credentials fail their jobs at once with
    the reason, and the one worker goes on to the next job."""
    pytest.importorskip("torch")
    from elastune_demo import build as tiny_build
    from elastune_demo import tasks as tiny_tasks
    from local_run import condition, elastune, status_of, tuning_job, warm_pool, write
    from tiny_test_model import TASK, TEST_SPEC

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    model = str(tiny_build.ensure_tiny_model(spec=TEST_SPEC))
    task = tiny_tasks.make_task(TASK, n_train=40, n_eval=8, seed=1)
    data = tmp_path / "good.jsonl"
    tiny_tasks.write_jsonl(list(task.train) + list(task.eval), data)

    def secret(name: str, **override: str) -> dict:
        keys = emulator.secret_keys(**override)
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": keys}

    def job(name: str, uri: str, secret_name: str, deadline: str) -> dict:
        out = {"uri": uri, "secretName": secret_name}
        return tuning_job(name, str(data), model=model, deadline=deadline, iterations=10, output=out)

    manifest = write(
        tmp_path / "jobs.yaml",
        secret("s3-good"),
        secret("s3-wrong", AWS_SECRET_ACCESS_KEY="not-the-key"),
        warm_pool(model),
        # Earlier deadlines first: the failing jobs run before the good one, on the same worker.
        job("nobucket", "s3://no-such-bucket/jobs/x", "s3-good", "6m"),
        job("badcreds", f"s3://{BUCKET}/jobs/badcreds", "s3-wrong", "7m"),
        job("good", f"s3://{BUCKET}/jobs/good", "s3-good", "8m"),
    )
    state = tmp_path / "state"
    proc = elastune("run", "-f", str(manifest), "--workers", "1", "--state-dir", str(state), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for name, reason in (("nobucket", "StorageBucketNotFound"), ("badcreds", "StorageAccessDenied")):
        st = status_of(state, name)
        assert condition(st, "Succeeded")["reason"] == reason, st
        assert condition(st, "Failed")["status"] == "True" and st.get("iterations", 0) == 0
    good = status_of(state, "good")
    assert condition(good, "Succeeded")["status"] == "True", good
    assert good["artifactURI"] == f"s3://{BUCKET}/jobs/good"
    keys = {o["Key"] for o in emulator.client().list_objects_v2(Bucket=BUCKET, Prefix="jobs/")["Contents"]}
    assert "jobs/good/adapter_config.json" in keys and not any(k.startswith("jobs/badcreds") for k in keys)
    # The credentials stay on this machine's disk for the workers, owner-only.
    assert (state / "s3-secrets" / "s3-good" / "AWS_SECRET_ACCESS_KEY").stat().st_mode & 0o077 == 0


def test_the_pool_pods_mount_the_named_secrets_read_only_and_optional() -> None:
    from elastune_contract.api.warmpool import WarmPool
    from elastune_operator.k8s.workload import worker_deployment

    pool = WarmPool.model_validate(
        {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "WarmPool",
            "metadata": {"name": "p", "namespace": "team-a"},
            "spec": {"model": MODEL, "maxWarmGPUs": 1, "worker": {"image": "elastune/worker:dev"}},
        }
    )
    pod = worker_deployment(pool, 1, "redis://r", None, s3_secrets={"s3-b", "s3-a"})["spec"]["template"][
        "spec"
    ]
    s3_volumes = [v for v in pod["volumes"] if v["name"].startswith("s3-")]
    assert [v["secret"] for v in s3_volumes] == [
        {"secretName": "s3-a", "optional": True},
        {"secretName": "s3-b", "optional": True},
    ]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["name"].startswith("s3-")]
    assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [
        ("/var/run/elastune/s3/s3-a", True),
        ("/var/run/elastune/s3/s3-b", True),
    ]
    env = json.dumps(pod["containers"][0]["env"])
    assert "AWS_" not in env, "only the Secret's name reaches the pod spec, as a volume"


def test_elastune_serve_serves_a_lora_adapter_from_s3(
    tmp_path: Path,
    emulator: s3_emulator.S3Emulator,
    tiny_lora: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`elastune serve -f` with a Secret manifest and a LoRAAdapter whose artifactURL is s3://: the worker
    downloads it with the Secret the adapter names and the gateway answers with it."""
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    docs = [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-good"},
         "stringData": emulator.secret_keys()},
        {"apiVersion": "elastune.dev/v1alpha1", "kind": "WarmPool", "metadata": {"name": "tiny-llama"},
         "spec": {"model": MODEL, "maxWarmGPUs": 1, "idleWindow": "600s", "serving": {"minReplicas": 1}}},
        {"apiVersion": "elastune.dev/v1alpha1", "kind": "LoRAAdapter", "metadata": {"name": "units-s3"},
         "spec": {"baseModel": MODEL, "artifactURL": f"s3://{BUCKET}/adapters/tiny-r8", "rank": 8,
                  "artifactSecret": "s3-good"}},
    ]  # fmt: skip
    serve = ElastuneServe(write_manifests(tmp_path / "manifests", docs), tmp_path / "state")
    try:
        client = serve.wait_up().openai_client(timeout=120)
        deadline = time.monotonic() + 120
        while "units-s3" not in {m.id for m in client.models.list().data}:
            assert time.monotonic() < deadline, "serve never listed units-s3"
            time.sleep(0.5)
        answer = client.completions.create(model="units-s3", prompt="12 km →", max_tokens=6, temperature=0)
        assert answer.model == "units-s3" and answer.choices[0].text
        # Downloaded with the named Secret and loaded on the worker.
        assert serve.status("LoRAAdapter", "units-s3").get("loadedOn")
    finally:
        serve.stop()
