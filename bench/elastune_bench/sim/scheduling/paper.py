"""What the PromptTuner paper reports about its scheduler, transcribed from its text ("PromptTuner:
SLO-Aware Elastic System for LLM Prompt Tuning", Gao et al., arXiv:2603.05087v1; the figures' plotted
values are not in the text, only what the prose states about them). Each constant cites the section,
figure or table it comes from.

Conventions: violations in percent of jobs, costs in US dollars for one 20-minute trace; a
"violation-point difference" is baseline % − PromptTuner %; a "cost saving" is 1 − PromptTuner's cost /
the baseline's; a ratio is baseline / PromptTuner.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- absolute anchors (the calibrated workload is fitted to these) ------------------------------------

TABLE8: dict[str, tuple[float, float]] = {
    # §6.3, Table 8 — medium load, S = 1.0: (SLO violation %, cost $).
    "workloadScheduler": (12.4, 22.9),
    "withoutWarmAllocator": (27.8, 20.9),
    "withoutDelaySchedulable": (15.6, 26.6),
    "withoutLatencyBudget": (16.3, 23.2),
}

ELASTICFLOW_UTILIZATION_PCT = 56.0
"""§3.1, Fig. 3(a): "On average, ElasticFlow only achieves 56% GPU cluster utilization" — Vicuna-7B
jobs of the first 20 minutes of the Fig. 2(b) trace, the §6.1 setup (32 A100s)."""

INFLESS_INIT_WAIT_PCT = 11.0
"""§3.2, Fig. 3(b): "instance initialization contributes on average 11% to the end-to-end LPT job
latency, and up to 50% in the worst case" — same Vicuna-7B trace."""

INFLESS_INIT_WAIT_MAX_PCT = 50.0
"""§3.2, Fig. 3(b): the worst case of the same distribution (reported, not fitted)."""

ALLOCATION_OVERHEAD_SHARE_PCT = (37.0, 41.0)
"""§2.2: GPU allocation overhead (container, framework, runtime) is 37–41 % of an LPT job's total
execution time (reported as a sanity check of T_cold against job durations, not fitted)."""

# -- the headline ------------------------------------------------------------------------------------

ABSTRACT_UP_TO: dict[str, float] = {
    # Abstract and §1: PromptTuner "reduces the SLO violation by up to 4.0× (INFless) and 7.9×
    # (ElasticFlow), and reduces the cost by up to 1.6× (INFless) and 4.5× (ElasticFlow)".
    "slo_vs_infless": 4.0,
    "slo_vs_elasticflow": 7.9,
    "cost_vs_infless": 1.6,
    "cost_vs_elasticflow": 4.5,
}


# -- Fig. 7, setting by setting ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fig7Setting:
    """What §6.2's prose says about one setting of Fig. 7 (None: nothing stated for it).

    Ranges are (low, high), high None for "at least"; a range stated over several settings is given
    to each of them. "% SLO violation reduction" is read as percentage points (a relative reading,
    15–25 % of INFless's rate, could not reach the abstract's ratios)."""

    source: str
    viol_points_vs_infless: tuple[float, float | None] | None = None
    viol_points_vs_elasticflow: tuple[float, float | None] | None = None
    cost_saving_vs_infless: float | None = None
    cost_saving_vs_elasticflow_max: float | None = None
    """An "up to" figure: the largest saving over the settings it was stated for."""


_LOADS_TEXT = (
    '§6.2, Fig. 7(a-b): S = 1.0, "15-25% SLO violation reduction compared to INFless and 48-51% '
    'SLO violation reduction compared to ElasticFlow" (over low / medium / high load)'
)
_SLO_TEXT = (
    '§6.2, Fig. 7(c-d): medium load, "at least 10% SLO violation reduction across varying SLO '
    'levels"; cost vs INFless "reduces the expenses by 38%, 23%, and 17% at S = 0.5, 1.0, and 1.5"; '
    'vs ElasticFlow "up to 70% at S = 1.5"'
)

FIG7: dict[str, Fig7Setting] = {
    "low_S1.0": Fig7Setting(_LOADS_TEXT, (15.0, 25.0), (48.0, 51.0)),
    "high_S1.0": Fig7Setting(_LOADS_TEXT, (15.0, 25.0), (48.0, 51.0)),
    "medium_S0.5": Fig7Setting(_SLO_TEXT, (10.0, None), (10.0, None), 0.38),
    "medium_S1.0": Fig7Setting(_LOADS_TEXT + "; " + _SLO_TEXT, (15.0, 25.0), (48.0, 51.0), 0.23),
    "medium_S1.5": Fig7Setting(_SLO_TEXT, (10.0, None), (10.0, None), 0.17, 0.70),
}
"""Settings of our 3 × 3 grid the paper plots (Fig. 7 varies load at S = 1.0 and S at medium load);
low/high load at S = 0.5 and 1.5 are ours only."""


def implied_ratios_medium() -> dict[str, tuple[float, float]]:
    """The ratios the paper implies at medium load, S = 1.0, from Table 8 and §6.2's differences:
    PromptTuner 12.4 %, INFless 12.4 + 15..25 %, ElasticFlow 12.4 + 48..51 %; INFless's cost
    22.9 / (1 − 0.23). ElasticFlow's cost at S = 1.0 is not stated; its bill is a fixed cluster
    (32 GPUs for ~20–25 minutes: $55–68 at the p4de price), which gives ≈ 2.4–3.0×."""
    pt_v = TABLE8["workloadScheduler"][0]
    lo_i, hi_i = 15.0, 25.0  # FIG7["medium_S1.0"].viol_points_vs_infless
    lo_e, hi_e = 48.0, 51.0  # FIG7["medium_S1.0"].viol_points_vs_elasticflow
    saving = FIG7["medium_S1.0"].cost_saving_vs_infless or 0.0
    return {
        "slo_vs_infless": ((pt_v + lo_i) / pt_v, (pt_v + hi_i) / pt_v),
        "slo_vs_elasticflow": ((pt_v + lo_e) / pt_v, (pt_v + hi_e) / pt_v),
        "cost_vs_infless": (1.0 / (1.0 - saving), 1.0 / (1.0 - saving)),
        "cost_vs_elasticflow": (2.4, 3.0),
    }


TABLE7 = {
    # §6.2, Table 7 (heavy workloads; other models and a 96-GPU cluster): (violation %, cost $).
    "LLaMA-30B": {"promptTuner": (28.4, 38.8), "infless": (38.9, 46.4), "elasticflow": (82.3, 69.4)},
    "Qwen7B-R1": {"promptTuner": (23.1, 30.7), "infless": (36.2, 42.8), "elasticflow": (74.9, 70.1)},
    "Large-Scale": {"promptTuner": (25.4, 57.2), "infless": (57.1, 65.9), "elasticflow": (78.2, 99.1)},
}

FIG8C_BEST_WINDOW_SECONDS = 60.0
"""§6.3, Fig. 8(c): "setting 60 seconds strikes a satisfactory balance between the SLO violation and
cost" (the plotted values are not in the text)."""

BANK_MIN_SPEEDUP = 1.2
"""§4.4.3: "the Prompt Bank can yield a 1.2-4.7× speedup compared to the induction initialization";
the latency budget (20 % of the SLO) is derived from the minimum."""
