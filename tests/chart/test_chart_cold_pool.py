"""The chart's cold pool: operator.coldPool.nodeSelector reaches the operator as a label selector, and
the operator may read Nodes, never write them, in both RBAC modes (docs/concepts/capacity.md)."""

from __future__ import annotations

from typing import Any

import pytest

from chart_render import RELEASE, named, of_kind, render


def operator_env(docs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    container = named(docs, "Deployment", f"{RELEASE}-operator")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize(
    ("sets", "selector"),
    [
        ((), "elastune.dev/pool=cold"),
        (("operator.coldPool.nodeSelector.gpu=a100",), "elastune.dev/pool=cold,gpu=a100"),
    ],
)
def test_the_cold_pool_selector_reaches_the_operator(sets: tuple[str, ...], selector: str) -> None:
    assert operator_env(render(*sets))["ELASTUNE_COLD_POOL_NODE_SELECTOR"] == selector


@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={team-a}",)])
def test_the_operator_reads_nodes_cluster_wide_and_never_writes_them(sets: tuple[str, ...]) -> None:
    docs = render(*sets)
    bound = {b["roleRef"]["name"] for b in of_kind(docs, "ClusterRoleBinding")}
    verbs = {
        verb
        for role in of_kind(docs, "ClusterRole")
        if role["metadata"]["name"] in bound
        for rule in role["rules"]
        if "nodes" in rule["resources"] and rule["apiGroups"] == [""]
        for verb in rule["verbs"]
    }
    assert verbs == {"get", "list", "watch"}
