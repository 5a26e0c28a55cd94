"""The serving half of the control core against a real redis-server: LoRAAdapter validation with a
reason for every bad input, placement written per worker, status from what workers report, the serving
need (scale from zero while the gateway holds requests), delete waiting for the unload, tune -> serve."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastune_common.bus import Bus
from elastune_common.servers import Server
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.api.warmpool import ServingSpec
from elastune_contract.protocol import AdapterState, ServingDemand, ServingState, WorkerRecord, WorkerState
from elastune_contract.vocabulary import Reason
from elastune_operator.control.serving import AdapterRecord, ServingControl

MODEL = "elastune/tiny-llama"


@pytest.fixture
def bus(redis_server: Server) -> Iterator[Bus]:
    b = Bus(redis_server.url, namespace=f"t{time.monotonic_ns()}")
    yield b
    b.close()


def peft_dir(root: Path, name: str, **config: object) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config})
    )
    return path


def adapter(name: str, url: str, **spec: object) -> AdapterRecord:
    return AdapterRecord(
        "default", name, LoRAAdapterSpec.model_validate({"baseModel": MODEL, "artifactURL": url, **spec})
    )


def worker(
    wid: str, adapters: list[AdapterState] | None = None, errors: dict[str, str] | None = None
) -> WorkerRecord:
    serving = ServingState(
        model=MODEL, max_model_len=2048, max_loras=2, adapters=adapters or [], placement_errors=errors or {}
    )
    return WorkerRecord(
        id=wid, pool="tiny-llama", model=MODEL, state=WorkerState.READY, started_at=0, serving=serving
    )


def ready(rec: AdapterRecord) -> tuple[str, str]:
    c = next(c for c in rec.status.conditions if c.type == "Ready")
    return c.status, c.reason


def test_every_bad_adapter_gets_a_reason_and_the_good_one_is_placed(bus: Bus, tmp_path: Path) -> None:
    control = ServingControl(bus)
    control.add_pool("tiny-llama", MODEL, ServingSpec(max_lora_rank=32))
    (tmp_path / "plain").mkdir()
    cases = {
        "good": adapter("good", str(peft_dir(tmp_path, "g"))),
        "missing": adapter("missing", str(tmp_path / "nowhere")),
        "not-peft": adapter("not-peft", str(tmp_path / "plain")),
        "too-big": adapter("too-big", str(peft_dir(tmp_path, "b", r=64, lora_alpha=128))),
        "mismatch": adapter("mismatch", str(peft_dir(tmp_path, "m")), rank=16),
        "wrong-type": adapter("wrong-type", str(peft_dir(tmp_path, "w")), type="promptTuning"),
        "https": adapter("https", "https://example.com/adapter"),
        MODEL: adapter(MODEL, str(peft_dir(tmp_path, "c"))),
    }
    other = AdapterRecord(
        "default", "other-base", LoRAAdapterSpec.model_validate({"baseModel": "gpt2", "artifactURL": "/x"})
    )
    for rec in [*cases.values(), other]:
        control.upsert_adapter(rec)
    control.tick({"w1": worker("w1")})
    assert ready(cases["good"]) == ("True", Reason.SERVABLE)
    expected = {
        "missing": Reason.ARTIFACT_NOT_FOUND,
        "not-peft": Reason.NOT_A_PEFT_ADAPTER,
        "too-big": Reason.RANK_ABOVE_MAXIMUM,
        "mismatch": Reason.ARTIFACT_MISMATCH,
        "wrong-type": Reason.ARTIFACT_MISMATCH,
        "https": Reason.ARTIFACT_UNSUPPORTED_SCHEME,
        MODEL: Reason.NAME_CLASHES_WITH_MODEL,
    }
    assert {name: ready(cases[name])[1] for name in expected} == expected
    assert ready(other) == ("False", Reason.UNKNOWN_MODEL)
    # Only the good one reaches the worker and the gateway's pool record.
    assert set(bus.placement("w1")) == {"default/good"}
    assert bus.serving_pools()["default/tiny-llama"].adapters == {"default/good": 8}


def test_status_follows_the_workers_and_their_load_errors(bus: Bus, tmp_path: Path) -> None:
    sent: list[str] = []
    control = ServingControl(bus, on_status=lambda rec: sent.append(rec.name))
    control.add_pool("tiny-llama", MODEL, None)
    good = adapter("good", str(peft_dir(tmp_path, "g")))
    control.upsert_adapter(good)
    control.tick({})
    assert [c.reason for c in good.status.conditions] == [Reason.SERVABLE, Reason.NO_WARM_POD]
    control.tick(
        {
            "w1": worker(
                "w1",
                [AdapterState(name="good", namespace="default", rank=8, tier="device", load_seconds=0.25)],
            )
        }
    )
    assert [(p.pod, p.tier) for p in good.status.loaded_on] == [("w1", "device")]
    assert good.status.ready_replicas == 1 and good.status.load_seconds == "0.250"
    control.tick({"w1": worker("w1", errors={"default/good": "shapes of another base model"})})
    assert ready(good) == ("False", Reason.ADAPTER_LOAD_FAILED)
    assert "another base model" in good.status.conditions[0].message
    n = len(sent)
    control.tick({"w1": worker("w1", errors={"default/good": "shapes of another base model"})})
    assert len(sent) == n  # unchanged status: not written again


def test_serving_need_scales_from_zero_while_requests_wait(bus: Bus, tmp_path: Path) -> None:
    control = ServingControl(bus)
    control.add_pool("tiny-llama", MODEL, ServingSpec(min_replicas=0))
    control.upsert_adapter(adapter("good", str(peft_dir(tmp_path, "g"))))
    assert control.serving_need("default/tiny-llama") == 0  # by pool id
    bus.post_demand(
        ServingDemand(model="default/good", waiting=1, oldest_since=time.time(), updated_at=time.time())
    )
    assert control.serving_need("default/tiny-llama") == 1  # a request for its adapter counts for the pool
    control.add_pool("tiny-llama", MODEL, ServingSpec(min_replicas=3))
    assert control.serving_need("default/tiny-llama") == 3


def test_delete_waits_until_no_worker_holds_it(bus: Bus, tmp_path: Path) -> None:
    control = ServingControl(bus)
    control.add_pool("tiny-llama", MODEL, None)
    control.upsert_adapter(adapter("good", str(peft_dir(tmp_path, "g"))))
    holding = {"w1": worker("w1", [AdapterState(name="good", namespace="default", rank=8, tier="host")])}
    control.tick(holding)
    assert "default/good" in bus.placement("w1")
    assert control.delete_adapter("default", "good", holding) is False
    control.tick(holding)
    assert bus.placement("w1") == {}  # the worker is told to unload it
    assert control.delete_adapter("default", "good", {"w1": worker("w1")}) is True
    assert "default/good" not in control.adapters


def test_a_cluster_operator_leaves_worker_paths_to_the_workers(bus: Bus, tmp_path: Path) -> None:
    """On Kubernetes a file:// artifact is on the worker pods' filesystem (a published prompt under their
    work dir): the operator places it unchecked and the worker's load error becomes the condition."""
    control = ServingControl(bus, check_artifact_paths=False)
    control.add_pool("tiny-llama", MODEL, ServingSpec(max_lora_rank=32))
    remote = adapter("remote", "file:///tmp/elastune/artifacts/job/u1", rank=8)
    cloud = adapter("cloud", "https://example.com/adapter")
    control.upsert_adapter(remote)
    control.upsert_adapter(cloud)
    control.tick({"w1": worker("w1")})
    assert ready(remote) == ("True", Reason.SERVABLE) and set(bus.placement("w1")) == {"default/remote"}
    assert ready(cloud) == ("False", Reason.ARTIFACT_UNSUPPORTED_SCHEME)  # still refused up front
    control.tick(
        {"w1": worker("w1", errors={"default/remote": "no adapter_config.json in /tmp/elastune/..."})}
    )
    assert ready(remote) == ("False", Reason.ADAPTER_LOAD_FAILED)


def test_gateway_counts_add_up_across_replicas_and_windows_expire(bus: Bus, redis_server: Server) -> None:
    from elastune_contract.protocol import POPULARITY_WINDOW_S

    other = Bus(redis_server.url, namespace=bus.ns)  # a second gateway replica
    t = 1_800_000_000.0 - 1_800_000_000.0 % POPULARITY_WINDOW_S
    bus.count_requests({"a": 3, "b": 1}, now=t)
    other.count_requests({"a": 2}, now=t + 1)
    assert bus.popularity(now=t + 2) == {"a": 5, "b": 1}
    other.count_requests({"b": 4}, now=t + POPULARITY_WINDOW_S)
    assert bus.popularity(now=t + POPULARITY_WINDOW_S) == {"a": 5, "b": 5}  # last full window + this one
    assert bus.popularity(now=t + 2 * POPULARITY_WINDOW_S) == {"b": 4}
    other.close()


def test_popular_adapters_get_more_replicas(bus: Bus, tmp_path: Path) -> None:
    """Automatic replicas = ceil(share of the pool's adapter requests x ready pods), from the gateway's
    counts: 90 % of the requests put `hot` on all three pods, `cold` stays on one."""
    now = time.time()
    control = ServingControl(bus, clock=lambda: now)
    control.add_pool("tiny-llama", MODEL, ServingSpec(max_loras=2, max_cpu_loras=4))
    for name in ("hot", "cold"):
        control.upsert_adapter(adapter(name, str(peft_dir(tmp_path, name))))
    bus.count_requests({"default/hot": 90, "default/cold": 10, MODEL: 500}, now=now)
    control.tick({w: worker(w) for w in ("w1", "w2", "w3")})
    held = {w: set(bus.placement(w)) for w in ("w1", "w2", "w3")}
    assert sum("default/hot" in h for h in held.values()) == 3
    assert sum("default/cold" in h for h in held.values()) == 1


def test_an_adapter_in_use_is_never_moved_and_a_deleted_one_waits_for_its_requests(
    bus: Bus, tmp_path: Path
) -> None:
    """The workers report running requests per adapter; placement keeps such an adapter where it is even
    when another pod would now be preferred, and deleting one in use neither crashes the round nor
    marks it gone before its requests finish."""
    control = ServingControl(bus)
    control.add_pool("tiny-llama", MODEL, ServingSpec(max_loras=1, max_cpu_loras=1))
    for name in ("a", "b"):
        control.upsert_adapter(adapter(name, str(peft_dir(tmp_path, name))))
    busy = AdapterState(name="b", namespace="default", rank=8, tier="device", running=2)
    workers = {"w1": worker("w1", [busy]), "w2": worker("w2")}
    control.tick(workers)
    assert set(bus.placement("w1")) == {"default/b"} and set(bus.placement("w2")) == {"default/a"}
    assert control.delete_adapter("default", "b", workers) is False
    control.tick(workers)  # in use and being deleted: no record, no crash, nothing new placed there
    assert bus.placement("w1") == {}
    assert control.delete_adapter("default", "b", {"w1": worker("w1"), "w2": workers["w2"]}) is True
