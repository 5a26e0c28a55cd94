"""The pod world (docs/design.md §8): Elastune as it runs on a cluster, each pod its own host.

One world per test module (pods are CPU-hungry on two cores): the chart's operator, gateway and Redis
pods from `helm template`, worker pods from the Deployments the operator writes. Needs root for
network and mount namespaces; elsewhere every test here skips, saying why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import AuthenticationError, OpenAI

from elastune_testing.podworld import PodWorld, available

RELEASE_NAMESPACE = "elastune-system"
TENANT = "team-a"
MODEL = "elastune/tiny-llama"
API_KEY = "team-a-podworld-key"
"""The tenant's API key: a Secret labelled elastune.dev/api-key in its namespace (the chart turns
gateway authentication on; the operator publishes the key's hash and scope)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    why = available()
    if why is None:
        return
    for item in items:
        if "tests/cluster" in str(item.path):
            item.add_marker(pytest.mark.skip(reason=why))


@contextmanager
def chart_world(root: Path, *sets: str, strings: tuple[str, ...] = ()) -> Iterator[PodWorld]:
    """A pod world with the chart installed (`helm template` with ``sets`` / ``strings``) and its Redis,
    operator and gateway pods ready."""
    with PodWorld.start(root, gpu_nodes=2) as w:
        w.helm_install(*sets, strings=strings)
        for component in ("redis", "operator", "gateway"):
            w.wait_ready(RELEASE_NAMESPACE, f"app.kubernetes.io/component={component}", timeout=120)
        yield w


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodWorld]:
    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model

    # The worker image carries the model (here: the project's tiny Llama, built once on the host).
    ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    with chart_world(
        tmp_path_factory.mktemp("podworld"),
        # kopf peering needs the KopfPeering CRD the chart's hook creates; one operator runs standalone.
        "operator.peering.enabled=false",
        # Pods that cannot be scheduled fail their pool's jobs after 3 s here, not the default 60 s.
        strings=(
            "operator.extraEnv[0].name=ELASTUNE_POD_UNSCHEDULABLE_GRACE",
            "operator.extraEnv[0].value=3",
        ),
    ) as w:
        w.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "team-a-key",
                    "namespace": TENANT,
                    "labels": {"elastune.dev/api-key": "true"},
                },
                "stringData": {"key": API_KEY},
            }
        )
        yield w


def gateway_url(world: PodWorld) -> str:
    return world.service_url(RELEASE_NAMESPACE, "elastune-gateway", 8000) + "/v1"


def served(client: OpenAI) -> set[str]:
    try:
        return {m.id for m in client.models.list().data}
    except AuthenticationError:  # the operator publishes a new key's hash within seconds
        return set()


def warm_pool(name: str, namespace: str = TENANT, **spec: object) -> dict[str, object]:
    return {
        "apiVersion": "elastune.dev/v1alpha1",
        "kind": "WarmPool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": MODEL,
            "minWarmGPUs": 0,
            "maxWarmGPUs": 2,
            "worker": {"image": "ghcr.io/elastune/worker:test"},
            **spec,
        },
    }
