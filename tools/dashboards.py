"""Generate Elastune's Grafana dashboards with grafana-foundation-sdk (Grafana 11.x dashboard schema).

Writes ``helm/elastune/dashboards/{jobs-and-slos,pools-and-cost,workers,serving}.json``; the chart wraps
each file in a ConfigMap for the Grafana sidecar. Every query names metrics exactly as ``ControlMetrics``
(operator/elastune_operator/metrics.py), ``WorkerMetrics`` (worker/elastune_worker/server/metrics.py),
``ServingMetrics`` (worker/elastune_worker/engine/api/metrics.py: the ``vllm:`` names and the engine's
``elastune_`` counters) and ``GatewayMetrics`` (gateway/elastune_gateway/server/metrics.py) expose them —
counters with ``_total``, histograms as ``_bucket``/``_sum``/``_count`` — and tests/chart/test_dashboards.py
checks both that and that the files equal this script's output.

    python tools/dashboards.py           # (re)write the JSON files
    python tools/dashboards.py --check   # exit 1 when a file differs from what would be written
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models

OUT_DIR: Final = Path(__file__).resolve().parents[1] / "helm" / "elastune" / "dashboards"
TAGS: Final = ["elastune"]
DATASOURCE: Final = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
# The p4de.24xlarge price per GPU-hour the README's cost figures use; editable on the dashboard.
DEFAULT_GPU_PRICE: Final = "5.12"
MODEL: Final = 'model=~"$model"'
NAMESPACE: Final = 'namespace=~"$namespace"'
# The workers' serving metrics name the base model they serve in `model_name` (vLLM's label); the
# gateway's name what the request asked for in `model` (a base model or a LoRAAdapter).
BASE_MODEL: Final = 'model_name=~"$model_name"'
# The gateway's per-model series also carry the model's namespace (an adapter is namespace/name; a base
# model's is its WarmPool's): `model_namespace`, since the scrape's own `namespace` is the gateway pod's.
GATEWAY_MODEL: Final = 'model_namespace=~"$model_namespace", model=~"$model"'
BY_GATEWAY_MODEL: Final = "model_namespace, model"
# The operator's per-LLM series also carry the namespace of the WarmPool (two namespaces may each have a
# pool of one model): `pool_namespace`, since the scrape's own `namespace` is the operator pod's.
POOL_MODEL: Final = 'pool_namespace=~"$pool_namespace", model=~"$model"'
BY_POOL_MODEL: Final = "pool_namespace, model"
SUM_BY_POOL: Final = f"sum by ({BY_POOL_MODEL}) "
POOL_LEGEND: Final = "{{pool_namespace}} {{model}}"
# The operator's metrics name the LLM in `model`: on the serving dashboard it follows $model_name.
OPERATOR_MODEL: Final = 'model=~"$model_name"'
TIER: Final = "sum by (model_name, tier) "
# SLO thresholds of the serving dashboard: bucket bounds of the workers' TTFT and TPOT histograms
# (ServingMetrics' _LATENCY_BUCKETS and _TOKEN_BUCKETS, written as the `le` label prints them), so the
# attainment is the exact count of requests within the bound, not an interpolation between buckets.
TTFT_SLO_CHOICES: Final = ("0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0")
TTFT_SLO_DEFAULT: Final = "1.0"
TPOT_SLO_CHOICES: Final = ("0.01", "0.025", "0.05", "0.1", "0.25", "0.5")
TPOT_SLO_DEFAULT: Final = "0.1"


# -- building blocks -----------------------------------------------------------------------------


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).range()


def quantiles(metric: str, by: str, selector: str, window: str, qs: Sequence[float]) -> list[tuple[str, str]]:
    """histogram_quantile over `metric`_bucket, one (expr, legend) per quantile."""
    group = f"le, {by}" if by else "le"
    legend_by = "".join(f"{{{{{label}}}}} " for label in by.split(", ")) if by else ""
    matchers = f"{{{selector}}}" if selector else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{matchers}[{window}])))",
            f"{legend_by}p{round(q * 100)}",
        )
        for q in qs
    ]


def graph(
    title: str,
    description: str,
    unit: str,
    targets: Sequence[tuple[str, str]],
    *,
    span: int = 12,
    stacked: bool = False,
    bars: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(span)
        .height(8)
        .min(0)
        .fill_opacity(30 if stacked else 10)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max", "lastNotNull"])
        )
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    if bars:
        panel = panel.draw_style(common.GraphDrawStyle.BARS)
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + index)))
    return panel


def single(title: str, description: str, unit: str, expr: str, *, span: int = 6) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(span)
        .height(5)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(query(expr, " ", "A"))
    )


def base(uid: str, title: str, description: str) -> dashboard_builders.Dashboard:
    return (
        dashboard_builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(models.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("1m")
        .timezone("browser")
        .link(
            dashboard_builders.DashboardLink("Elastune")
            .type(models.DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
        .with_variable(
            dashboard_builders.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
    )


def model_variable(
    metric: str, name: str = "model", label: str = "Model"
) -> dashboard_builders.QueryVariable:
    return (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({metric}, {name})")
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def pool_namespace_variable(metric: str) -> dashboard_builders.QueryVariable:
    return model_variable(metric, "pool_namespace", "Namespace (WarmPool)")


def window_variable() -> dashboard_builders.CustomVariable:
    # Jobs end minutes apart: ratios and quantiles over a rate interval would mostly be empty.
    return (
        dashboard_builders.CustomVariable("window")
        .label("Window")
        .description("Look-back window of SLO ratios, latency quantiles and outcome counts.")
        .values("15m,1h,6h,1d")
        .current(models.VariableOption(selected=True, text="1h", value="1h"))
    )


def threshold_variable(
    name: str, label: str, description: str, choices: Sequence[str], default: str
) -> dashboard_builders.CustomVariable:
    return (
        dashboard_builders.CustomVariable(name)
        .label(label)
        .description(description)
        .values(",".join(choices))
        .current(models.VariableOption(selected=True, text=default, value=default))
        # A typed value between two bounds would match no bucket and show an empty ratio.
        .allow_custom_value(False)
    )


def with_panels(
    dashboard: dashboard_builders.Dashboard, rows: Sequence[tuple[str, Sequence[object]]]
) -> dashboard_builders.Dashboard:
    """Add the panels row by row with ids 1, 2, … so the JSON is stable and panel links work."""
    next_id = 1
    for title, panels in rows:
        dashboard = dashboard.with_row(dashboard_builders.Row(title).id(next_id))
        next_id += 1
        for panel in panels:
            dashboard = dashboard.with_panel(panel.id(next_id))  # type: ignore[attr-defined]
            next_id += 1
    return dashboard


def series(metric: str, *matchers: str) -> str:
    """`metric{m1, m2}`, or the bare name without matchers."""
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def increase(metric: str, *matchers: str, window: str = "$window") -> str:
    return f"increase({series(metric, *matchers)}[{window}])"


def rate(metric: str, *matchers: str, window: str = "$__rate_interval") -> str:
    return f"rate({series(metric, *matchers)}[{window}])"


def ratio(numerator: str, denominator: str, by: str = "") -> str:
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}({numerator}) / {agg}({denominator})"


# -- dashboards ----------------------------------------------------------------------------------


def jobs_and_slos() -> dashboard_builders.Dashboard:
    slo = "elastune_tuningjob_slo_total"
    met, missed = 'result="met"', 'result="missed"'
    bank = "elastune_prompt_bank_lookup_duration_seconds"
    rows = [
        (
            "SLOs",
            [
                single(
                    "SLO attainment",
                    "Share of finished TuningJobs that met their deadline over the window.",
                    "percentunit",
                    ratio(increase(slo, met, POOL_MODEL), increase(slo, POOL_MODEL)),
                ),
                single(
                    "Jobs pending",
                    "TuningJobs waiting for GPUs now.",
                    "short",
                    f"sum({series('elastune_tuningjobs_pending', POOL_MODEL)})",
                ),
                single(
                    "Jobs submitted",
                    "TuningJobs accepted over the window.",
                    "short",
                    f"sum({increase('elastune_tuningjobs_submitted_total', POOL_MODEL)})",
                ),
                single(
                    "Jobs missing their SLO",
                    "Finished TuningJobs over the window whose deadline passed first.",
                    "short",
                    f"sum({increase(slo, missed, POOL_MODEL)})",
                ),
                graph(
                    "SLO attainment by model",
                    "Met / finished over the sliding window, per LLM.",
                    "percentunit",
                    [
                        (
                            ratio(
                                increase(slo, met, POOL_MODEL), increase(slo, POOL_MODEL), by=BY_POOL_MODEL
                            ),
                            POOL_LEGEND,
                        )
                    ],
                ),
                graph(
                    "Job latency (creation to completion)",
                    "p50 and p99 of TuningJob latency per LLM over the window.",
                    "s",
                    quantiles(
                        "elastune_tuningjob_latency_seconds",
                        BY_POOL_MODEL,
                        POOL_MODEL,
                        "$window",
                        (0.5, 0.99),
                    ),
                ),
            ],
        ),
        (
            "Jobs",
            [
                graph(
                    "Pending jobs",
                    "TuningJobs waiting for GPUs (Algorithm 1 gave them none yet).",
                    "short",
                    [(SUM_BY_POOL + f"({series('elastune_tuningjobs_pending', POOL_MODEL)})", POOL_LEGEND)],
                    span=8,
                ),
                graph(
                    "Finished jobs by outcome",
                    "TuningJobs that ended over the window: succeeded, failed or cancelled.",
                    "short",
                    [
                        (
                            "sum by (outcome) "
                            f"({increase('elastune_tuningjobs_finished_total', POOL_MODEL)})",
                            "{{outcome}}",
                        )
                    ],
                    span=8,
                    stacked=True,
                ),
                graph(
                    "Submitted jobs",
                    "TuningJobs accepted per minute.",
                    "short",
                    [
                        (
                            SUM_BY_POOL + f"({rate('elastune_tuningjobs_submitted_total', POOL_MODEL)}) * 60",
                            POOL_LEGEND,
                        )
                    ],
                    span=8,
                ),
            ],
        ),
        (
            "Prompt Bank",
            [
                graph(
                    "Prompt Bank decisions",
                    "Per job over the window: used, skipped (latency budget: lookup over 20 % of the SLO) "
                    "or failed.",
                    "short",
                    [
                        (
                            f"sum by (result) ({increase('elastune_prompt_bank_lookups_total', POOL_MODEL)})",
                            "{{result}}",
                        )
                    ],
                    stacked=True,
                ),
                graph(
                    "Prompt Bank lookup time",
                    "p50 and p99 wall time of a lookup, and the mean.",
                    "s",
                    [
                        *quantiles(bank, "", POOL_MODEL, "$window", (0.5, 0.99)),
                        (
                            ratio(
                                rate(f"{bank}_sum", POOL_MODEL, window="$window"),
                                rate(f"{bank}_count", POOL_MODEL, window="$window"),
                            ),
                            "mean",
                        ),
                    ],
                ),
            ],
        ),
        (
            "Operator",
            [
                graph(
                    "Handler errors",
                    "Unexpected errors in reconcile handlers over the window (the object is retried).",
                    "short",
                    [(f"sum by (handler) ({increase('elastune_handler_errors_total')})", "{{handler}}")],
                    bars=True,
                ),
                graph(
                    "Registry: re-assertions, poison records, returning workers",
                    "What the control plane rewrote in Redis (periodic, after a reconnect, after Redis lost "
                    "it), malformed entries it skipped by kind, and workers used again after their record "
                    "had expired, over the window.",
                    "short",
                    [
                        (
                            f"sum by (why) ({increase('elastune_control_reasserts_total')})",
                            "re-assert {{why}}",
                        ),
                        (
                            f"sum by (kind) ({increase('elastune_control_poison_records_total')})",
                            "poison {{kind}}",
                        ),
                        (f"sum ({increase('elastune_control_workers_returned_total')})", "workers returned"),
                        (
                            f"sum by (kind) ({increase('elastune_control_unvouched_records_total')})",
                            "unvouched {{kind}}",
                        ),
                    ],
                    bars=True,
                ),
            ],
        ),
    ]
    dashboard = base(
        "elastune-jobs-slos",
        "Elastune / Jobs and SLOs",
        "TuningJob deadlines met, latency, queueing and Prompt Bank use (PromptTuner's SLO view).",
    )
    dashboard = (
        dashboard.with_variable(pool_namespace_variable("elastune_tuningjobs_pending"))
        .with_variable(model_variable("elastune_tuningjobs_pending"))
        .with_variable(window_variable())
    )
    return with_panels(dashboard, rows)


def pools_and_cost() -> dashboard_builders.Dashboard:
    gpus = "elastune_warm_gpus"
    paid = "elastune_gpu_seconds_total"
    overhead = "elastune_allocation_overhead_seconds"
    rounds = "elastune_scheduling_round_duration_seconds"
    rows = [
        (
            "Cost",
            [
                single(
                    "Cost now",
                    "Warm GPUs being paid (busy or idle) times the price per GPU-hour.",
                    "currencyUSD",
                    f"sum({rate(paid, POOL_MODEL)}) * $gpu_price",
                ),
                single(
                    "Cost over the time range",
                    "GPU-hours paid in warm pools over the dashboard's time range times the price.",
                    "currencyUSD",
                    f"sum({increase(paid, POOL_MODEL, window='$__range')}) / 3600 * $gpu_price",
                ),
                single(
                    "Warm-GPU utilisation",
                    "Busy warm GPUs / all warm GPUs now: idle warm GPUs cost as much as busy ones.",
                    "percentunit",
                    ratio(series(gpus, 'state="busy"', POOL_MODEL), series(gpus, POOL_MODEL)),
                ),
                single(
                    "Cold pool free",
                    "GPUs left in the shared cold pool (nothing loaded, free of charge).",
                    "short",
                    "max(elastune_cold_pool_free_gpus)",
                ),
                graph(
                    "Cost rate by model ($/h)",
                    "GPU-seconds paid per second (= warm GPUs) times $gpu_price per GPU-hour.",
                    "currencyUSD",
                    [(SUM_BY_POOL + f"({rate(paid, POOL_MODEL)}) * $gpu_price", POOL_LEGEND)],
                    stacked=True,
                    span=24,
                ),
            ],
        ),
        (
            "Pools",
            [
                graph(
                    "Warm GPUs by state",
                    "Per LLM: starting (taken from the cold pool), idle, held (reserved by "
                    "DelaySchedulable) and busy.",
                    "short",
                    [
                        (
                            f"sum by ({BY_POOL_MODEL}, state) ({series(gpus, POOL_MODEL)})",
                            "{{pool_namespace}} {{model}} {{state}}",
                        )
                    ],
                    stacked=True,
                ),
                graph(
                    "Cold pool free GPUs",
                    "GPUs the warm pools can still grow into.",
                    "short",
                    [("max(elastune_cold_pool_free_gpus)", "free")],
                ),
                graph(
                    "Allocation overhead T_cold",
                    "Seconds from a cold-pool GPU to a warm worker: p50, p99 and mean per LLM.",
                    "s",
                    [
                        *quantiles(overhead, BY_POOL_MODEL, POOL_MODEL, "$__range", (0.5, 0.99)),
                        (
                            ratio(
                                rate(f"{overhead}_sum", POOL_MODEL, window="$__range"),
                                rate(f"{overhead}_count", POOL_MODEL, window="$__range"),
                                by=BY_POOL_MODEL,
                            ),
                            "{{pool_namespace}} {{model}} mean",
                        ),
                    ],
                ),
                graph(
                    "Scheduling round time",
                    "Wall time of one round of Algorithms 1 and 2 (one round every 50 ms).",
                    "s",
                    [
                        *quantiles(rounds, "", "", "$__rate_interval", (0.5, 0.99)),
                        (f"sum({rate(f'{rounds}_count')})", "rounds/s"),
                    ],
                ),
            ],
        ),
    ]
    dashboard = base(
        "elastune-pools-cost",
        "Elastune / Pools and cost",
        "Warm and cold GPU pools per LLM, what they cost, allocation overhead and scheduler speed.",
    )
    dashboard = (
        dashboard.with_variable(pool_namespace_variable(gpus))
        .with_variable(model_variable(gpus))
        .with_variable(
            dashboard_builders.TextBoxVariable("gpu_price")
            .label("$ per GPU-hour")
            .description("Price of one GPU-hour in a warm pool (default: AWS p4de.24xlarge / 8).")
            .default_value(DEFAULT_GPU_PRICE)
        )
    )
    return with_panels(dashboard, rows)


def workers() -> dashboard_builders.Dashboard:
    compute = "elastune_worker_step_compute_seconds"
    sync = "elastune_worker_step_sync_seconds"
    step_time = f"sum({rate(f'{compute}_sum', NAMESPACE)}) + sum({rate(f'{sync}_sum', NAMESPACE)})"
    rows = [
        (
            "Workers",
            [
                single(
                    "Ready workers",
                    "Workers with runtime and weights loaded (warm).",
                    "short",
                    f"sum({series('elastune_worker_ready', NAMESPACE)})",
                ),
                single(
                    "Busy workers",
                    "Workers running a job.",
                    "short",
                    f"sum({series('elastune_worker_busy', NAMESPACE)})",
                ),
                single(
                    "Gradient sync share",
                    "All-reduce time / (compute + all-reduce) per step; PromptTuner measures 0.4–0.5 %.",
                    "percentunit",
                    f"sum({rate(f'{sync}_sum', NAMESPACE)}) / ({step_time})",
                ),
                single(
                    "Steps per second",
                    "Optimizer steps of all workers.",
                    "short",
                    f"sum({rate('elastune_worker_steps_total', NAMESPACE)})",
                ),
                graph(
                    "Ready and busy workers",
                    "Warm workers and how many of them run a job.",
                    "short",
                    [
                        (
                            f"sum by (namespace) ({series('elastune_worker_ready', NAMESPACE)})",
                            "{{namespace}} ready",
                        ),
                        (
                            f"sum by (namespace) ({series('elastune_worker_busy', NAMESPACE)})",
                            "{{namespace}} busy",
                        ),
                    ],
                ),
                graph(
                    "Model load time",
                    "Seconds each worker took to load the runtime and weights.",
                    "s",
                    [
                        (
                            f"max by (pod) ({series('elastune_worker_model_load_seconds', NAMESPACE)})",
                            "{{pod}}",
                        )
                    ],
                ),
            ],
        ),
        (
            "Steps",
            [
                graph(
                    "Step compute vs gradient sync",
                    "p50 and p99 per step: forward, backward and optimizer; the storage-channel all-reduce.",
                    "s",
                    [
                        (expr, f"{label} {legend}")
                        for label, metric in (("compute", compute), ("sync", sync))
                        for expr, legend in quantiles(metric, "", NAMESPACE, "$__rate_interval", (0.5, 0.99))
                    ],
                ),
                graph(
                    "Jobs by outcome",
                    "Job assignments the workers ended over the window: succeeded, failed or cancelled.",
                    "short",
                    [
                        (
                            f"sum by (outcome) ({increase('elastune_worker_jobs_total', NAMESPACE)})",
                            "{{outcome}}",
                        )
                    ],
                    stacked=True,
                ),
                graph(
                    "Requests refused without the gateway's credential",
                    "Inference requests a worker refused because the gateway's signed per-request credential "
                    "was missing, expired, forged or named another namespace or model, by reason: nonzero "
                    "means something other than the gateway is calling workers.",
                    "short",
                    [
                        (
                            "sum by (reason) "
                            f"({increase('elastune_worker_request_credential_refused_total', NAMESPACE)})",
                            "{{reason}}",
                        )
                    ],
                ),
            ],
        ),
    ]
    dashboard = base(
        "elastune-workers",
        "Elastune / Workers",
        "Worker pods: warm and busy, step compute against gradient synchronisation, job outcomes.",
    )
    dashboard = dashboard.with_variable(
        dashboard_builders.QueryVariable("namespace")
        .label("Namespace")
        .datasource(DATASOURCE)
        .query("label_values(elastune_worker_ready, namespace)")
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(models.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    ).with_variable(window_variable())
    return with_panels(dashboard, rows)


def attainment(metric: str, threshold: str, by: str = "") -> str:
    """Share of the histogram's observations over the window at or below the `le` bucket `threshold`."""
    return ratio(
        increase(f"{metric}_bucket", f'le="{threshold}"', BASE_MODEL),
        increase(f"{metric}_count", BASE_MODEL),
        by=by,
    )


def serving() -> dashboard_builders.Dashboard:
    requests = "elastune_gateway_requests_total"
    routed = "elastune_gateway_routed_requests_total"
    waiting = "elastune_gateway_waiting_requests"
    ttft = "vllm:time_to_first_token_seconds"
    tpot = "vllm:time_per_output_token_seconds"
    e2e = "vllm:e2e_request_latency_seconds"
    hits, queried = "elastune_prefix_cache_hit_tokens_total", "elastune_prefix_cache_queried_tokens_total"
    by_model = "sum by (model_name) "
    rows = [
        (
            "Requests (gateway)",
            [
                single(
                    "Requests per second",
                    "Requests the gateway answered, all models and adapters.",
                    "reqps",
                    f"sum({rate(requests, GATEWAY_MODEL)})",
                ),
                single(
                    "Error share",
                    "Answers that were not 2xx (the gateway's own 4xx/5xx and the workers' errors).",
                    "percentunit",
                    ratio(rate(requests, 'code!~"2.."', GATEWAY_MODEL), rate(requests, GATEWAY_MODEL)),
                ),
                single(
                    "In flight",
                    "Requests being served by a worker now.",
                    "short",
                    "sum(elastune_gateway_inflight_requests)",
                ),
                single(
                    "Waiting for scale-up",
                    "Requests held because their pool has no warm endpoint (scale from zero).",
                    "short",
                    f"sum({series(waiting, GATEWAY_MODEL)})",
                ),
                graph(
                    "Request rate by model / adapter",
                    "Requests per second by the OpenAI `model` field: a base LLM or a LoRAAdapter ('-': the "
                    "request named no known model).",
                    "reqps",
                    [
                        (
                            f"sum by ({BY_GATEWAY_MODEL}) ({rate(requests, GATEWAY_MODEL)})",
                            "{{model_namespace}} {{model}}",
                        )
                    ],
                    stacked=True,
                ),
                graph(
                    "Answers by status",
                    "Requests per second by HTTP status code.",
                    "reqps",
                    [(f"sum by (code) ({rate(requests, GATEWAY_MODEL)})", "{{code}}")],
                    stacked=True,
                ),
            ],
        ),
        (
            "Latency and SLOs (workers)",
            [
                single(
                    "TTFT SLO attainment",
                    "Share of requests over the window whose time to first token was at most $ttft_slo s "
                    "(the histogram bucket of that bound).",
                    "percentunit",
                    attainment(ttft, "$ttft_slo"),
                ),
                single(
                    "TPOT SLO attainment",
                    "Share of requests (with more than one output token) over the window whose time per "
                    "output token was at most $tpot_slo s.",
                    "percentunit",
                    attainment(tpot, "$tpot_slo"),
                ),
                single(
                    "TTFT p99",
                    "99th percentile of the time to first token over the window.",
                    "s",
                    quantiles(ttft, "", BASE_MODEL, "$window", (0.99,))[0][0],
                ),
                single(
                    "TPOT p99",
                    "99th percentile of the time per output token over the window.",
                    "s",
                    quantiles(tpot, "", BASE_MODEL, "$window", (0.99,))[0][0],
                ),
                graph(
                    "Time to first token",
                    "p50 and p99 per base model (vllm:time_to_first_token_seconds).",
                    "s",
                    quantiles(ttft, "model_name", BASE_MODEL, "$__rate_interval", (0.5, 0.99)),
                ),
                graph(
                    "Time per output token",
                    "p50 and p99 per base model (vllm:time_per_output_token_seconds).",
                    "s",
                    quantiles(tpot, "model_name", BASE_MODEL, "$__rate_interval", (0.5, 0.99)),
                ),
                graph(
                    "SLO attainment by model",
                    "Per base model over the sliding window: share of requests within the TTFT threshold "
                    "($ttft_slo s) and within the TPOT threshold ($tpot_slo s), each from its histogram.",
                    "percentunit",
                    [
                        (attainment(ttft, "$ttft_slo", by="model_name"), "{{model_name}} TTFT"),
                        (attainment(tpot, "$tpot_slo", by="model_name"), "{{model_name}} TPOT"),
                    ],
                ),
                graph(
                    "End-to-end latency",
                    "p50 and p99 per base model on the worker (vllm:e2e_request_latency_seconds).",
                    "s",
                    quantiles(e2e, "model_name", BASE_MODEL, "$__rate_interval", (0.5, 0.99)),
                ),
            ],
        ),
        (
            "Adapters and prefix cache (workers)",
            [
                graph(
                    "Prefix-cache hit rate",
                    "Prompt tokens served from the prefix cache / prompt tokens looked up, per base model.",
                    "percentunit",
                    [
                        (
                            ratio(rate(hits, BASE_MODEL), rate(queried, BASE_MODEL), by="model_name"),
                            "{{model_name}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "Adapter loads",
                    "load_lora_adapter calls (registering an adapter on a worker) over the window by "
                    "outcome; the Adapters row shows the tier loads they lead to.",
                    "short",
                    [
                        (
                            f"sum by (model_name, outcome) "
                            f"({increase('elastune_lora_adapter_loads_total', BASE_MODEL)})",
                            "{{model_name}} {{outcome}}",
                        )
                    ],
                    span=8,
                    bars=True,
                ),
                graph(
                    "Preemptions",
                    "Requests preempted (recomputed later) per second when KV blocks ran out.",
                    "short",
                    [(f"{by_model}({rate('elastune_preemptions_total', BASE_MODEL)})", "{{model_name}}")],
                    span=8,
                ),
            ],
        ),
        (
            "Adapters (workers)",
            [
                graph(
                    "Adapters resident by tier",
                    "LoRA adapters held in device slots and in host memory, summed over the pool's workers.",
                    "short",
                    [
                        (
                            f"{TIER}({series('elastune_lora_adapters_resident', BASE_MODEL)})",
                            "{{model_name}} {{tier}}",
                        )
                    ],
                    span=8,
                    stacked=True,
                ),
                graph(
                    "Adapter cold starts by tier",
                    "Loads per second: host = read from storage (first use or after a host eviction), "
                    "device = copied from host into a slot (CaraServe's cold start).",
                    "ops",
                    [
                        (
                            f"{TIER}({rate('elastune_lora_tier_loads_total', BASE_MODEL)})",
                            "{{model_name}} {{tier}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "Mean adapter load time by tier",
                    "Seconds per load over the rate window (load seconds / loads), per tier.",
                    "s",
                    [
                        (
                            ratio(
                                rate("elastune_lora_tier_load_seconds_total", BASE_MODEL),
                                rate("elastune_lora_tier_loads_total", BASE_MODEL),
                                by="model_name, tier",
                            ),
                            "{{model_name}} {{tier}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "Adapter evictions by tier",
                    "Adapters pushed out of a device slot or host memory by LRU, per second: sustained "
                    "evictions mean maxLoras / maxCpuLoras are too small for the traffic's adapter mix.",
                    "ops",
                    [
                        (
                            f"{TIER}({rate('elastune_lora_evictions_total', BASE_MODEL)})",
                            "{{model_name}} {{tier}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "CPU-assisted prefills",
                    "Requests per second whose prefill ran with the adapter's delta computed on the CPU "
                    "while its copy was in flight (CaraServe's cold start), and the steps that did so.",
                    "ops",
                    [
                        (
                            "sum by (model_name) "
                            f"({rate('elastune_lora_cpu_assisted_prefills_total', BASE_MODEL)})",
                            "{{model_name}} prefills",
                        ),
                        (
                            "sum by (model_name) "
                            f"({rate('elastune_lora_cpu_assisted_steps_total', BASE_MODEL)})",
                            "{{model_name}} steps",
                        ),
                    ],
                    span=8,
                ),
                graph(
                    "Workers running each adapter set",
                    "vLLM's vllm:lora_requests_info: workers whose running batch holds these adapters.",
                    "short",
                    [
                        (
                            "count by (running_lora_adapters) "
                            '(vllm:lora_requests_info{running_lora_adapters!=""})',
                            "{{running_lora_adapters}}",
                        )
                    ],
                    span=8,
                ),
            ],
        ),
        (
            "Engine (workers)",
            [
                graph(
                    "Running and waiting requests",
                    "Requests in the running batch and in the engine's waiting queue, per base model.",
                    "short",
                    [
                        (
                            f"{by_model}({series('vllm:num_requests_running', BASE_MODEL)})",
                            "{{model_name}} running",
                        ),
                        (
                            f"{by_model}({series('vllm:num_requests_waiting', BASE_MODEL)})",
                            "{{model_name}} waiting",
                        ),
                    ],
                    span=8,
                ),
                graph(
                    "KV-cache usage",
                    "Share of KV blocks in use per worker pod (1 = full).",
                    "percentunit",
                    [(f"max by (pod) ({series('vllm:kv_cache_usage_perc', BASE_MODEL)})", "{{pod}}")],
                    span=8,
                ),
                graph(
                    "Token throughput",
                    "Prompt tokens processed and tokens generated per second, per base model.",
                    "short",
                    [
                        (
                            f"{by_model}({rate('vllm:prompt_tokens_total', BASE_MODEL)})",
                            "{{model_name}} prompt",
                        ),
                        (
                            f"{by_model}({rate('vllm:generation_tokens_total', BASE_MODEL)})",
                            "{{model_name}} generated",
                        ),
                    ],
                    span=8,
                ),
                graph(
                    "Finished requests by reason",
                    "Requests the workers finished per second: stop, length or abort.",
                    "reqps",
                    [
                        (
                            f"sum by (finished_reason) ({rate('vllm:request_success_total', BASE_MODEL)})",
                            "{{finished_reason}}",
                        )
                    ],
                    stacked=True,
                ),
                graph(
                    "Worker errors by status",
                    "Requests a worker answered with an error per second, by HTTP status.",
                    "reqps",
                    [(f"sum by (code) ({rate('elastune_serving_errors_total', BASE_MODEL)})", "{{code}}")],
                    stacked=True,
                ),
            ],
        ),
        (
            "Co-serving (FlexLLM: finetuning beside inference)",
            [
                graph(
                    "Engine busy share",
                    "Share of wall time each worker's engine spent in steps, and the part of it that "
                    "co-served finetuning took (the rest is inference).",
                    "percentunit",
                    [
                        (
                            f"sum by (pod) ({rate('elastune_engine_busy_seconds_total', BASE_MODEL)})",
                            "{{pod}} busy",
                        ),
                        (
                            f"sum by (pod) ({rate('elastune_coserve_finetune_seconds_total', BASE_MODEL)})",
                            "{{pod}} finetuning",
                        ),
                    ],
                    span=12,
                ),
                graph(
                    "Tuning attempts by placement",
                    "TuningJob attempts the control plane started per base model: co-served on pods that "
                    "serve inference, or on dedicated pods (the operator's counter).",
                    "short",
                    [
                        (
                            "sum by (placement) "
                            f"({increase('elastune_tuningjob_attempts_started_total', OPERATOR_MODEL)})",
                            "{{placement}}",
                        )
                    ],
                    span=12,
                    bars=True,
                ),
            ],
        ),
        (
            "Routing (gateway)",
            [
                graph(
                    "Routing decisions by policy",
                    "Requests sent to an endpoint per second, by the routing policy that chose it.",
                    "reqps",
                    [(f"sum by (policy) ({rate(routed, GATEWAY_MODEL)})", "{{policy}}")],
                    span=8,
                    stacked=True,
                ),
                graph(
                    "E2 decisions (Preble)",
                    "Requests per second by Preble's E2 decision: exploit (to an endpoint caching the "
                    "prompt's prefix), rebalance (its holder was over 1.5x the lightest load), explore "
                    "(lowest load cost), pd-balance (to a decode-heavy endpoint).",
                    "reqps",
                    [
                        (
                            "sum by (decision) "
                            f"({rate('elastune_gateway_routing_decisions_total', GATEWAY_MODEL)})",
                            "{{decision}}",
                        )
                    ],
                    span=8,
                    stacked=True,
                ),
                graph(
                    "Requests per endpoint",
                    "Requests sent to each worker endpoint per second (the routing's load balance).",
                    "reqps",
                    [(f"sum by (endpoint) ({rate(routed, GATEWAY_MODEL)})", "{{endpoint}}")],
                    span=8,
                ),
                graph(
                    "Endpoints per model",
                    "Worker endpoints the gateway knows per model: up, or down (set aside after a failure).",
                    "short",
                    [
                        (
                            f"sum by (model, state) ({series('elastune_gateway_endpoints', MODEL)})",
                            "{{model}} {{state}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "Requests waiting for scale-up",
                    "Requests held per model while its pool has no warm endpoint.",
                    "short",
                    [
                        (
                            f"sum by ({BY_GATEWAY_MODEL}) ({series(waiting, GATEWAY_MODEL)})",
                            "{{model_namespace}} {{model}}",
                        )
                    ],
                    span=8,
                ),
                graph(
                    "Hold time",
                    "p50 and p99 of how long requests waited for a warm endpoint (scale from zero).",
                    "s",
                    quantiles(
                        "elastune_gateway_hold_seconds",
                        BY_GATEWAY_MODEL,
                        GATEWAY_MODEL,
                        "$__rate_interval",
                        (0.5, 0.99),
                    ),
                    span=8,
                ),
                graph(
                    "Rejected requests",
                    "Requests refused by the gateway per second, by reason (unknown_model, invalid, context, "
                    "no_endpoint: 503 after the hold timeout, waiting_room_full: 429).",
                    "reqps",
                    [
                        (
                            f"sum by (reason) ({rate('elastune_gateway_rejected_requests_total')})",
                            "{{reason}}",
                        )
                    ],
                    span=8,
                    stacked=True,
                ),
                graph(
                    "Upstream failures and retries",
                    "Requests an endpoint failed per second, by kind, and requests retried on another "
                    "endpoint.",
                    "reqps",
                    [
                        (
                            f"sum by (kind) ({rate('elastune_gateway_upstream_failures_total')})",
                            "{{kind}}",
                        ),
                        (f"sum({rate('elastune_gateway_retried_requests_total')})", "retried"),
                    ],
                    span=8,
                ),
                graph(
                    "Worker records set aside (not vouched for)",
                    "Registry records the gateway skips because no pool record vouches for their id and "
                    "address, by reason: nonzero means a worker record was rewritten or is stale.",
                    "short",
                    [
                        ("sum by (reason) (elastune_gateway_unvouched_endpoints)", "now: {{reason}}"),
                        (
                            f"sum by (reason) ({rate('elastune_gateway_unvouched_records_total')})",
                            "new/s: {{reason}}",
                        ),
                    ],
                    span=8,
                ),
                graph(
                    "Latency seen by clients",
                    "p50 and p99 at the gateway: arrival to the first streamed byte, and to the last byte.",
                    "s",
                    [
                        (expr, f"{label} {legend}")
                        for label, metric in (
                            ("first byte", "elastune_gateway_time_to_first_byte_seconds"),
                            ("complete", "elastune_gateway_request_duration_seconds"),
                        )
                        for expr, legend in quantiles(
                            metric, "", GATEWAY_MODEL, "$__rate_interval", (0.5, 0.99)
                        )
                    ],
                    span=8,
                ),
                graph(
                    "SSJF length predictions",
                    "Output-length predictions per second by outcome; 'configured' is 1 when the gateway has "
                    "a predictor (gateway.lengthPredictor), else requests queue FCFS.",
                    "short",
                    [
                        (
                            f"sum by (outcome) ({rate('elastune_gateway_length_predictions_total')})",
                            "{{outcome}}",
                        ),
                        ("max(elastune_gateway_length_predictor_configured)", "configured"),
                    ],
                    span=8,
                ),
            ],
        ),
        (
            "Gateway: API keys and registry",
            [
                graph(
                    "Requests and tokens per API key",
                    "Answers per second by key (the Secret's namespace/name, never the key) and status, and "
                    "tokens per second by kind.",
                    "short",
                    [
                        (
                            f"sum by (key, code) ({rate('elastune_gateway_key_requests_total')})",
                            "{{key}} {{code}}",
                        ),
                        (
                            f"sum by (key, kind) ({rate('elastune_gateway_key_tokens_total')})",
                            "{{key}} {{kind}} tokens",
                        ),
                    ],
                    span=8,
                ),
                graph(
                    "Rate limited",
                    "Requests refused with 429 per second by key and limit (requests or tokens per minute); "
                    "limiter errors are requests let through while Redis could not count them.",
                    "short",
                    [
                        (
                            f"sum by (key, limit) ({rate('elastune_gateway_rate_limited_requests_total')})",
                            "{{key}} {{limit}}",
                        ),
                        (f"sum({rate('elastune_gateway_rate_limit_errors_total')})", "limiter errors"),
                    ],
                    span=8,
                ),
                graph(
                    "Registry view",
                    "Age of the gateway's last good registry view (it routes from it while a refresh fails), "
                    "failed refreshes per second, and malformed registry entries skipped by kind.",
                    "short",
                    [
                        ("max(elastune_gateway_registry_age_seconds)", "view age (s)"),
                        (
                            f"sum({rate('elastune_gateway_registry_refresh_failures_total')})",
                            "refresh failures",
                        ),
                        (
                            f"sum by (kind) ({rate('elastune_gateway_poison_records_total')})",
                            "poison {{kind}}",
                        ),
                    ],
                    span=8,
                ),
            ],
        ),
    ]
    dashboard = base(
        "elastune-serving",
        "Elastune / Serving",
        "Inference through the gateway and the warm workers: request rates by model and adapter, TTFT and "
        "TPOT against SLO thresholds, prefix-cache reuse, adapter loads, routing decisions and scale from "
        "zero.",
    )
    dashboard = (
        dashboard.with_variable(
            model_variable(
                "elastune_gateway_requests_total", "model_namespace", "Namespace (model / adapter)"
            )
        )
        .with_variable(model_variable("elastune_gateway_requests_total", "model", "Model / adapter"))
        .with_variable(model_variable("vllm:num_requests_running", "model_name", "Base model"))
        .with_variable(window_variable())
        .with_variable(
            threshold_variable(
                "ttft_slo",
                "TTFT SLO (s)",
                "Time-to-first-token threshold of the attainment panels: a bucket bound of the workers' "
                "TTFT histogram, so the share is exact.",
                TTFT_SLO_CHOICES,
                TTFT_SLO_DEFAULT,
            )
        )
        .with_variable(
            threshold_variable(
                "tpot_slo",
                "TPOT SLO (s)",
                "Time-per-output-token threshold of the attainment panels: a bucket bound of the workers' "
                "TPOT histogram, so the share is exact.",
                TPOT_SLO_CHOICES,
                TPOT_SLO_DEFAULT,
            )
        )
    )
    return with_panels(dashboard, rows)


DASHBOARDS: Final[dict[str, Callable[[], dashboard_builders.Dashboard]]] = {
    "jobs-and-slos": jobs_and_slos,
    "pools-and-cost": pools_and_cost,
    "workers": workers,
    "serving": serving,
}


def render(name: str) -> str:
    """The JSON text of one dashboard, exactly as written to disk."""
    return json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a file differs instead of writing")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output directory (default {OUT_DIR})")
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        path = args.out / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)
    for path in stale:
        print(f"{path} is stale: run python tools/dashboards.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
