"""The cold pool is the GPUs of the cluster's nodes (issue 37 item 4), in the pod world: the chart's
operator pod reads the Node objects the pod world registers for its kubelet's nodes. With no GPU node
nothing is planned; a GPU node joining lets a waiting job's pool grow onto it; when the node leaves no
further GPU is planned and the pod already running stays."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_tuning_path import CLAIM, DATA, claim, condition, custom_object, job_status, tuning_job

from conftest import RELEASE_NAMESPACE, TENANT, warm_pool
from elastune_testing.podworld import PodWorld

POOL = "capacity"
SELECTOR = f"elastune.dev/warmpool={POOL}"


@pytest.fixture(scope="module")
def bare_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodWorld]:
    """A world whose only node has no GPU (its own: the shared world has two GPU nodes)."""
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

    ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    with PodWorld.start(tmp_path_factory.mktemp("podworld"), gpu_nodes=0) as w:
        w.helm_install("operator.peering.enabled=false", "gateway.auth.enabled=false")
        for component in ("redis", "operator"):
            w.wait_ready(RELEASE_NAMESPACE, f"app.kubernetes.io/component={component}", timeout=120)
        yield w


def planned(world: PodWorld) -> int:
    """GPUs the scheduler took from the cold pool for the pool (its status: warm + starting)."""
    st = custom_object(world, "warmpools", POOL).get("status") or {}
    return int(st.get("warmGPUs") or 0) + int(st.get("startingGPUs") or 0)


def wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_the_pool_grows_onto_a_node_that_joins_and_stops_when_it_leaves(bare_world: PodWorld) -> None:
    world = bare_world
    world.apply(claim(CLAIM))
    claim_dir = world.root / "kubelet" / "pvc" / TENANT / CLAIM
    (claim_dir / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(DATA, claim_dir / "data" / "extract.jsonl")
    world.apply(warm_pool(POOL, volumes=[{"claimName": CLAIM, "jobStorage": True}]))
    world.apply(tuning_job("waits", termination={"maxIterations": 400}))

    wait("the pool's status", lambda: custom_object(world, "warmpools", POOL).get("status"), 60)
    time.sleep(5.0)  # many scheduling rounds with the job pending
    assert planned(world) == 0 and not world.pods(TENANT, SELECTOR), "planned GPUs with no GPU node"
    assert condition(job_status(world, "waits"), "Running").get("status") != "True"

    world.add_node("gpu-late", 1)
    wait("the job to run on the new node", lambda: condition(job_status(world, "waits"), "Running").get(
        "status") == "True", 240)  # fmt: skip
    assert planned(world) == 1
    running = [p["metadata"]["uid"] for p in world.pods(TENANT, SELECTOR)]
    running_names = [p["metadata"]["name"] for p in world.pods(TENANT, SELECTOR)]
    assert len(running) == 1

    world.remove_node("gpu-late")
    time.sleep(2.0)
    # Another job with a tight deadline wants GPUs; the cold pool has none left.
    world.apply(tuning_job("more", deadline="2m", termination={"maxIterations": 200}))
    for _ in range(20):
        time.sleep(0.5)
        assert planned(world) <= 1, json.dumps(custom_object(world, "warmpools", POOL).get("status"))
    assert [p["metadata"]["uid"] for p in world.pods(TENANT, SELECTOR)] == running, "the running pod went"
    # "more" may run once "waits" ends or is preempted for the tighter deadline, but only on the pod
    # that was already there: the node that left takes no new work.
    more = condition(job_status(world, "more"), "Running")
    if more.get("status") == "True":
        assert f"{TENANT}/{running_names[0]}" in more.get("message", ""), more
