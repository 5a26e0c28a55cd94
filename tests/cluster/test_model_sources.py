"""A WarmPool whose model lives on a hub: the operator's ``<pool>-model-fetch`` Job downloads it with the
real huggingface_hub client from the hub stand-in (a process on the node's address, which pods reach as
they reach any host service) into the pool's cache claim, the WarmPool says ModelReady, and only then
do worker pods start, load it offline from the read-only cache and answer a completion. A token the
hub refuses ends in ModelReady=False with the fetcher's reason, read from the Job's pod status, and no
worker pod."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from openai import OpenAI

from conftest import API_KEY, TENANT, gateway_url, served, warm_pool
from elastune_contract.vocabulary import ConditionType, Reason
from elastune_testing import hub_standin
from elastune_testing.podworld import PodWorld

TOKEN = "hf_podworld_token"
REPO = "elastune/tiny-llama"


@pytest.fixture(scope="module")
def hub(world: PodWorld, tmp_path_factory: pytest.TempPathFactory) -> Iterator[hub_standin.HubStandIn]:
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

    files = str(ensure_tiny_model(spec=TINY_LLAMA_SPEC))
    config = {"tokens": [TOKEN], "repos": {REPO: {"revisions": {"main": files}, "private": True}}}
    # On the node's address: the pods' default route, as a registry or hub outside the cluster would be.
    server = hub_standin.start(config, tmp_path_factory.mktemp("hub"), host=world.network.node_ip)
    world.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": "elastune-models", "namespace": TENANT}, "spec": {}})  # fmt: skip
    yield server
    server.stop()


def hub_pool(world: PodWorld, hub: hub_standin.HubStandIn, name: str, model: str, token: str) -> None:
    secret = {"name": f"{name}-hub", "namespace": TENANT}
    world.apply({"apiVersion": "v1", "kind": "Secret", "metadata": secret, "stringData": {"token": token}})
    pool = warm_pool(name, model=model, modelSource={"secretName": f"{name}-hub"}, serving={"minReplicas": 1})
    pool["spec"]["worker"]["env"] = [{"name": "HF_ENDPOINT", "value": hub.url}]
    world.apply(pool)


def condition(world: PodWorld, name: str, type_: str) -> dict[str, Any]:
    obj: Any = k8s.CustomObjectsApi(world.api).get_namespaced_custom_object(
        "elastune.dev", "v1alpha1", TENANT, "warmpools", name
    )
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_condition(world: PodWorld, name: str, status: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (c := condition(world, name, ConditionType.MODEL_READY)).get("status") != status:
        if time.monotonic() > deadline:
            pods = world.pods(TENANT, f"job-name={name}-model-fetch")
            logs = "\n".join(world.kubelet.log_of(TENANT, p["metadata"]["name"])[-1500:] for p in pods)
            raise AssertionError(f"ModelReady of {name} is {c}, not {status}\n{logs}")
        time.sleep(1)
    return c


def test_an_hf_model_is_fetched_by_a_job_then_served_by_workers_loading_it_offline(
    world: PodWorld, hub: hub_standin.HubStandIn
) -> None:
    model = f"hf://{REPO}@main"
    hub_pool(world, hub, "hub-llama", model, TOKEN)
    ready = wait_condition(world, "hub-llama", "True", timeout=180)
    assert ready["reason"] == Reason.MODEL_FETCHED
    assert hub.requests()[REPO].get("get", 0) >= 3  # config, tokenizer, weights came over HTTP
    workers = world.wait_ready(TENANT, "elastune.dev/warmpool=hub-llama", timeout=240)
    spec = workers[0]["spec"]["containers"][0]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in spec["env"] and "startupProbe" in spec
    client = OpenAI(base_url=gateway_url(world), api_key=API_KEY, max_retries=0, timeout=120)
    deadline = time.monotonic() + 60
    while model not in served(client):
        assert time.monotonic() < deadline, "the gateway never listed the pool's model"
        time.sleep(1)
    out = client.completions.create(model=model, prompt="12 km →", max_tokens=4, temperature=0)
    assert out.choices[0].text, out


def test_a_token_the_hub_refuses_ends_in_a_model_ready_condition_with_its_reason(
    world: PodWorld, hub: hub_standin.HubStandIn
) -> None:
    hub_pool(world, hub, "bad-token", f"hf://{REPO}@v9", "hf_not_a_token_the_hub_knows")
    failed = wait_condition(world, "bad-token", "False", timeout=180)
    assert failed["reason"] == Reason.MODEL_ACCESS_DENIED, failed
    assert "refused the token" in failed["message"]
    assert condition(world, "bad-token", ConditionType.READY)["reason"] == Reason.MODEL_ACCESS_DENIED
    assert not world.pods(TENANT, "elastune.dev/warmpool=bad-token"), "workers started without a model"
