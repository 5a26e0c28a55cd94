"""The chart keeps the gateway's /metrics (every key's and model's series) off the client path (issue 39
item 5): the client Service has only the client port, the metrics port has a Service of its own that the
ServiceMonitor selects, and the gateway's NetworkPolicy admits the metrics port only from Prometheus."""

from __future__ import annotations

from typing import Any

from elastune_testing.podworld.helm import template


def _by(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_gateway_metrics_port_is_apart_from_the_client_port() -> None:
    docs = template("elastune", "elastune-system", "metrics.serviceMonitor.enabled=true")
    container = _by(docs, "Deployment", "elastune-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "metrics": 9091}
    assert {"--metrics-port=9091", "--limits-on-redis-outage=closed"} <= set(container["args"])
    client = _by(docs, "Service", "elastune-gateway")
    assert [p["targetPort"] for p in client["spec"]["ports"]] == ["http"]
    scraped = _by(docs, "Service", "elastune-gateway-metrics")
    assert [p["targetPort"] for p in scraped["spec"]["ports"]] == ["metrics"]
    monitor = _by(docs, "ServiceMonitor", "elastune-gateway")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= scraped["metadata"]["labels"].items()
    assert not selector.items() <= client["metadata"]["labels"].items()  # the client Service is not scraped
    policy = _by(docs, "NetworkPolicy", "elastune-gateway")
    rules = {p["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert rules["http"] is None  # clients from anywhere
    assert rules["metrics"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]  # fmt: skip


def test_limits_outage_mode_is_a_value() -> None:
    docs = template("elastune", "elastune-system", "gateway.limitsOnRedisOutage=open")
    container = _by(docs, "Deployment", "elastune-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert "--limits-on-redis-outage=open" in container["args"]
