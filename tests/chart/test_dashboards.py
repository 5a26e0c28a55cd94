"""The Grafana dashboards are what tools/dashboards.py generates, load back through grafana-foundation-sdk,
and query only metrics that ControlMetrics, WorkerMetrics, the workers' ServingMetrics and GatewayMetrics
really expose (which promtool accepts)."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from elastune_gateway.server.metrics import GatewayMetrics
from elastune_operator.metrics import ControlMetrics
from elastune_worker.engine.api.metrics import ServingMetrics
from elastune_worker.engine.client import LoRAInfo
from elastune_worker.server.metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "helm" / "elastune" / "dashboards"
PROMTOOL_HINT = "promtool is missing: apt-get install -y --no-install-recommends prometheus (.ci/run does)"
# Grafana's own variables: not defined by the dashboards.
BUILT_IN_VARIABLES = {"__rate_interval", "__range", "__interval"}
# Elastune's own names, and the vLLM-compatible `vllm:` ones the workers export for routers.
METRIC_NAME = re.compile(r"\b(?:elastune_[a-z0-9_]+|vllm:[a-z0-9_]+)")
SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _load_generator() -> ModuleType:
    # tools/ is not a package on sys.path: load the script from its file.
    spec = importlib.util.spec_from_file_location(
        "elastune_tools_dashboards", REPO / "tools" / "dashboards.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _load_generator()


@functools.cache
def dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # collapsed rows nest their panels
    return found


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def serving_metrics() -> tuple[ServingMetrics, CollectorRegistry]:
    """A worker's serving metrics as its app registers them: the API's plus the engine's scrape-time ones."""
    registry = CollectorRegistry()
    metrics = ServingMetrics(registry, "m")
    metrics.watch_engine(registry, lambda: {}, lambda: LoRAInfo([], [], 2, {"device": 0, "host": 0}))
    return metrics, registry


def metric_set(source: str) -> tuple[object, CollectorRegistry]:
    if source == "ServingMetrics":
        return serving_metrics()
    metrics = {
        "ControlMetrics": ControlMetrics,
        "WorkerMetrics": WorkerMetrics,
        "GatewayMetrics": GatewayMetrics,
    }[source]()
    return metrics, metrics.registry


SOURCES = ("ControlMetrics", "WorkerMetrics", "ServingMetrics", "GatewayMetrics")


def exposition(source: str) -> str:
    """Text exposition with one observation on every metric, so labelled metrics have samples too."""
    metrics, registry = metric_set(source)
    for metric in vars(metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        labelnames = metric._labelnames
        child = metric.labels(*[f"v{i}" for i in range(len(labelnames))]) if labelnames else metric
        if isinstance(child, Counter):
            child.inc()
        elif isinstance(child, Gauge):
            child.set(1)
        elif isinstance(child, Histogram):
            child.observe(0.5)
        else:  # pragma: no cover - a new metric type needs a line here
            pytest.fail(f"unhandled metric type {type(metric).__name__}")
    return generate_latest(registry).decode()


def sample_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = SAMPLE_NAME.match(line)
            assert match is not None, line
            names.add(match.group())
    return names


@functools.cache
def exposed() -> dict[str, set[str]]:
    return {source: sample_names(exposition(source)) for source in SOURCES}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(PROMTOOL_HINT)
    return path


# -- generation ----------------------------------------------------------------------------------


def test_dashboard_files_are_what_the_generator_writes() -> None:
    on_disk = sorted(p.stem for p in DASHBOARD_DIR.glob("*.json"))
    assert on_disk == sorted(generator.DASHBOARDS), "run python tools/dashboards.py"
    for name in generator.DASHBOARDS:
        text = (DASHBOARD_DIR / f"{name}.json").read_text(encoding="utf-8")
        assert text == generator.render(name), f"{name}.json is stale: run python tools/dashboards.py"


def test_check_mode_reports_stale_files(tmp_path: Path) -> None:
    assert generator.main(["--out", str(tmp_path)]) == 0
    assert generator.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "workers.json").write_text("{}\n", encoding="utf-8")
    assert generator.main(["--out", str(tmp_path), "--check"]) == 1


DASHBOARD_NAMES = ["jobs-and-slos", "pools-and-cost", "workers", "serving"]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_dashboard_loads_back_through_the_sdk(name: str) -> None:
    register_default_plugins()
    data = dashboards()[name]
    model = Dashboard.from_json(data)
    assert model.uid == data["uid"] and model.title == data["title"]
    # Panels decode into the typed panel configs (timeseries/stat options) and encode back unchanged.
    assert json.loads(json.dumps(model, cls=JSONEncoder)) == data
    # Grafana 11.x dashboard schema (41 is Grafana 11.6's).
    assert 36 <= data["schemaVersion"] <= 41


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_dashboard_is_well_formed(name: str) -> None:
    data = dashboards()[name]
    assert data["uid"].startswith("elastune-") and data["title"].startswith("Elastune / ")
    assert "elastune" in data["tags"]
    ids = [p["id"] for p in panels(data)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    variables = {v["name"] for v in data["templating"]["list"]}
    assert "datasource" in variables
    for panel in panels(data):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel.get("description"), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= variables | BUILT_IN_VARIABLES, (panel["title"], used - variables)


def test_the_requested_views_exist() -> None:
    titles = {name: {p["title"] for p in panels(d)} for name, d in dashboards().items()}
    assert {
        "SLO attainment",
        "Job latency (creation to completion)",
        "Pending jobs",
        "Finished jobs by outcome",
        "Prompt Bank decisions",
        "Prompt Bank lookup time",
    } <= titles["jobs-and-slos"]
    assert {
        "Warm GPUs by state",
        "Cold pool free GPUs",
        "Cost rate by model ($/h)",
        "Allocation overhead T_cold",
        "Scheduling round time",
    } <= titles["pools-and-cost"]
    assert {"Ready and busy workers", "Step compute vs gradient sync", "Jobs by outcome"} <= titles["workers"]
    price = next(v for v in dashboards()["pools-and-cost"]["templating"]["list"] if v["name"] == "gpu_price")
    assert price["type"] == "textbox" and float(price["query"]) > 0
    assert {
        "Request rate by model / adapter",
        "Time to first token",
        "Time per output token",
        "TTFT SLO attainment",
        "TPOT SLO attainment",
        "SLO attainment by model",
        "Prefix-cache hit rate",
        "Adapter loads",
        "Routing decisions by policy",
        "Requests waiting for scale-up",
    } <= titles["serving"]


def variable(dashboard: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        v for v in dashboards()[dashboard]["templating"]["list"] if v["name"] == name
    )
    return found


@pytest.mark.parametrize(
    ("name", "histogram"),
    [("ttft_slo", "vllm:time_to_first_token_seconds"), ("tpot_slo", "vllm:time_per_output_token_seconds")],
)
def test_slo_thresholds_are_bucket_bounds_of_the_workers_histograms(name: str, histogram: str) -> None:
    """SLO attainment reads one bucket: every choice must be an `le` value the workers really export
    (printed as prometheus_client prints it, 1.0 not 1), or the ratio is silently empty."""
    bounds = set(
        re.findall(
            rf'^{re.escape(histogram)}_bucket\{{[^}}]*le="([^"]+)"', exposition("ServingMetrics"), re.M
        )
    )
    assert bounds, histogram
    threshold = variable("serving", name)
    choices = threshold["query"].split(",")  # Grafana builds a custom variable's options from it
    assert choices and set(choices) <= bounds, set(choices) - bounds
    assert threshold["current"]["value"] in choices and threshold["allowCustomValue"] is False
    exprs = [e for e in expressions(dashboards()["serving"]) if f"${name}" in e]
    assert exprs and all(f'{histogram}_bucket{{le="${name}"' in e for e in exprs), exprs


# -- metric names --------------------------------------------------------------------------------


def test_every_queried_metric_is_exposed() -> None:
    names = set().union(*exposed().values())
    for name, data in dashboards().items():
        for expr in expressions(data):
            for metric in METRIC_NAME.findall(expr):
                assert metric in names, f"{name}: {metric!r} is not exposed by {', '.join(SOURCES)}"


def test_every_exposed_metric_has_a_panel() -> None:
    queried = {m for data in dashboards().values() for e in expressions(data) for m in METRIC_NAME.findall(e)}
    for source, names in exposed().items():
        families = {re.sub(r"_(total|bucket|sum|count|created)$", "", n) for n in names}
        for family in families:
            assert any(q == family or q.startswith(f"{family}_") for q in queried), (
                f"{source} exposes {family} but no dashboard shows it: add a panel in tools/dashboards.py"
            )


def test_metric_name_check_fails_on_a_wrong_name() -> None:
    names = set().union(*exposed().values())
    # Counters carry _total, histograms _bucket/_sum/_count: the bare names must not be accepted.
    assert "elastune_tuningjobs_finished_total" in names
    assert "elastune_tuningjobs_finished" not in names
    assert "elastune_tuningjob_latency_seconds_bucket" in names
    assert "elastune_tuningjob_latency_seconds" not in names
    assert "vllm:time_to_first_token_seconds_bucket" in names
    assert "vllm:time_to_first_token_seconds" not in names
    assert METRIC_NAME.findall('rate(vllm:prompt_tokens_total{model_name=~"m"}[1m])') == [
        "vllm:prompt_tokens_total"
    ]


@pytest.mark.parametrize("source", SOURCES)
def test_promtool_check_metrics_is_clean(source: str) -> None:
    result = subprocess.run(
        [promtool(), "check", "metrics"],
        input=exposition(source),
        capture_output=True,
        text=True,
        check=False,
    )
    # The one accepted finding: the `vllm:` names keep vLLM's colon (what routers scrape), which
    # promtool's linter reserves for recording rules. Anything else fails.
    problems = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if line.strip() and not re.fullmatch(r"vllm:\S+ metric names should not contain ':'", line.strip())
    ]
    assert problems == [], result.stdout + result.stderr
    if source != "ServingMetrics":
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses every expression as a recording rule, Grafana variables replaced by values."""
    values = {
        "$__rate_interval": "1m",
        "$__range": "6h",
        "$window": "1h",
        "$gpu_price": "5.12",
        "$model": ".*",
        "$namespace": ".*",
        "$pool_namespace": ".*",
        "$model_name": ".*",
        "$ttft_slo": "1.0",
        "$tpot_slo": "0.1",
    }
    rules = []
    for name, data in dashboards().items():
        for index, expr in enumerate(t["expr"] for p in panels(data) for t in p.get("targets", [])):
            for variable, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
                expr = expr.replace(variable, value)
            assert "$" not in expr, expr
            rules.append({"record": f"elastune:{name.replace('-', '_')}:{index}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}), encoding="utf-8")
    result = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
