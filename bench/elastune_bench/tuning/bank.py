"""Prompt Bank benchmark, reproducing PromptTuner §6.3 (Figures 9 and 10) on the tiny task suite.

    elastune bench bank [--quick] [--json PATH] [--plot PATH] [--threads N]

(a) Iterations-to-accuracy (ITA) of promptTuning initialised from: the bank's pick (K = 50 lookup),
    random candidates, the brute-force best-score candidate (all C scored), and an induction prompt the
    model writes itself after reading a few demonstrations.
(b) Evaluations and latency of a lookup for K ∈ {1 (brute force), 10, √C, 50, 100} over C = 3,000.
(c) Distribution of top-1 / top-5 cosine similarity between candidates' activation features.

Design (why these settings; see elastune_demo/bank_model.py for the model):

* Model: the instruction-following tiny GPT-2 (``tiny.bank_model.ensure_bank_model``). The default
  tiny model shows no prompt sensitivity (its inputs identify the task, so any initial prompt converges
  after ~5 steps); the bench measures that too (``sensitivity`` and, in the full run,
  ``control_default_model``).
* Tuning: promptTuning, 20 virtual tokens TEXT-initialised from the candidate, AdamW with lr 0.003,
  batch 8, 64 training samples, eval loss on 32 held-out samples every 3 iterations, at most 60
  iterations. The learning rate keeps each step small next to the embedding scale (entries ~0.09),
  the regime where, as in the paper's LLMs, a poor initial prompt needs many steps to travel.
* Target: per task, the mean final eval loss of the random-candidate runs. This is the paper's rule
  ("average accuracy over … initial prompts randomly selected from the Prompt Bank", §6.1), with eval
  loss as the metric because the tiny models' exact-match accuracy is ~0 on most tasks. ITA = first
  evaluation at which the Trainer reaches the target (its own TargetReached rule); runs that never do
  count as the iteration budget (censored, flagged), which understates the random baseline's ITA.
* Lookup: score(p) on the first 16 of the eval samples, soft layout = the tuning run's loss at step 0;
  clusters capped at ⌈C/K⌉ (store.capped_assignment); the same score tables also give, without running
  them, what plain nearest-medoid FasterPAM clusters would cost and pick (``lookup_unbalanced_simulated``).
* K = 1 is the brute force: every candidate scored with the same scorer and batches as a lookup.

Full run ≈ 32 min on two busy CPU cores (24 tasks, 3 per family; the brute force dominates);
``--quick`` ≈ 5 min (8 tasks, 1,000 candidates, fewer random initialisations, no control).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from elastune_contract.vocabulary import Reason

__all__ = ["BenchConfig", "main", "run"]

FAMILIES_ORDER = ("sql", "case", "arith", "classify", "listops", "units", "dates", "extract")


@dataclass(frozen=True)
class BenchConfig:
    quick: bool = False
    n_candidates: int = 3000
    partitions: tuple[int, ...] = (1, 4, 7)
    ks: tuple[int, ...] = (1, 10, 0, 50, 100)  # 0 stands for √C
    k_pick: int = 50
    max_samples: int = 16
    n_train: int = 64
    n_eval: int = 32
    random_inits: int = 5
    learning_rate: float = 0.003
    max_iterations: int = 60
    eval_every: int = 3
    batch_size: int = 8
    virtual_tokens: int = 20
    batch_rows: int = 256
    seed: int = 0
    threads: int = 1
    control_tasks: int = 6  # tasks re-run on the default tiny model (0 = skip)
    demos: int = 4
    tasks: tuple[str, ...] = ()  # explicit task names (e.g. "units-01") instead of families × partitions

    @classmethod
    def make(cls, quick: bool) -> BenchConfig:
        if not quick:
            return cls()
        return cls(
            quick=True, n_candidates=1000, partitions=(2,), random_inits=3, max_iterations=45, control_tasks=0
        )

    def k_values(self) -> list[int]:
        sqrt_c = round(math.sqrt(self.n_candidates))
        return sorted({sqrt_c if k == 0 else k for k in self.ks})


@dataclass
class Run:
    """One tuning run from one initial prompt."""

    prompt: str
    ita: int
    reached: bool
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    final: float = math.nan
    seconds: float = 0.0


# --------------------------------------------------------------------------------------- helpers
def _log(msg: str) -> None:
    print(msg, flush=True)


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(statistics.median(xs)) if xs else math.nan


def _task_specs(cfg: BenchConfig) -> list[Any]:
    from elastune_demo import tasks as T

    if cfg.tasks:
        return [T.TaskSpec(n.rsplit("-", 1)[0], int(n.rsplit("-", 1)[1])) for n in cfg.tasks]
    return [T.TaskSpec(f, p) for f in FAMILIES_ORDER for p in cfg.partitions]


def _load(model_dir: Path) -> tuple[Any, Any]:
    from elastune_demo.build import load_tiny_model

    model, tok = load_tiny_model(model_dir)
    model.eval()
    return model, tok


def _make_bank(
    prompts: list[str], feats: np.ndarray, k: int, seed: int, template: Any, balanced: bool = True
) -> Any:
    from elastune_worker.bank.store import PromptBank, cluster

    labels, medoids, info = cluster(feats, k, seed, balanced)
    meta = replace(
        template, k=len(medoids), k_requested=k, balanced=balanced, build={**template.build, "kmedoids": info}
    )
    return PromptBank(prompts, feats, labels, medoids, meta)


def _simulated_pick(bank: Any, scores: np.ndarray) -> tuple[int, int]:
    """(index, evaluations) the two-layer lookup picks given every candidate's score."""
    c = int(np.argmin(scores[bank.medoids]))
    members = bank.members(c)
    # Same tie rule as lookup(): the medoid first, then ascending index.
    order = [int(bank.medoids[c]), *[int(i) for i in members if i != bank.medoids[c]]]
    best = order[int(np.argmin(scores[order]))]
    return best, bank.k + len(members) - 1


def similarity_stats(feats: np.ndarray) -> dict[str, Any]:
    """Top-1 and top-5 cosine similarity of each candidate to the others (top-5: the 5th nearest)."""
    sims = feats.astype(np.float64) @ feats.astype(np.float64).T
    np.fill_diagonal(sims, -np.inf)
    part = -np.sort(-sims, axis=1)[:, :5]
    top1, top5 = part[:, 0], part[:, 4]
    qs = (0.05, 0.25, 0.5, 0.75, 0.95)

    def desc(x: np.ndarray) -> dict[str, float]:
        return {"mean": float(x.mean()), **{f"p{int(q * 100)}": float(np.quantile(x, q)) for q in qs}}

    return {"top1": desc(top1), "top5": desc(top5), "_top1": top1.tolist(), "_top5": top5.tolist()}


def induction_prompt(model: Any, tok: Any, demos: list[dict[str, str]], max_new_tokens: int = 24) -> str:
    """What the model writes as an instruction after reading ``demos`` (Ye et al.-style induction).

    The demonstrations are laid out as in the corpus (``input → target`` lines) and followed by the end
    of document; the model then starts a new document, which in its corpus always opens with an
    instruction, and we keep its first line (greedy). A tiny model has no notion of "describe these
    examples", so this is the best-conditioned way to let it write a prompt itself; the paper notes
    induction works only when the LLM is capable (§6.3, weakest on GPT-2 Base).
    """
    import torch

    from elastune_demo import tasks as T

    context = "\n".join(T.format_example(d["input"], d["target"]) for d in demos) + "\n" + tok.eos_token
    ids = tok(context, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(
            **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    line = next((s.strip() for s in text.split("\n") if s.strip()), "")
    return line or T.format_example(demos[0]["input"], demos[0]["target"])


def tune(model_dir: Path, task: Any, prompt: str, cfg: BenchConfig, target: float | None) -> Run:
    """One promptTuning run initialised from ``prompt``; the Trainer stops at ``target`` (eval loss)."""
    from elastune_worker.tuning.trainer import Trainer, TuningConfig

    tc = TuningConfig(
        method="promptTuning",
        virtual_tokens=cfg.virtual_tokens,
        init_text=prompt,
        learning_rate=cfg.learning_rate,
        batch_size=cfg.batch_size,
        max_iterations=cfg.max_iterations,
        eval_every=cfg.eval_every,
        checkpoint_every=cfg.max_iterations,
        seed=cfg.seed,
        target_metric="loss" if target is not None else None,
        target_value=target,
    )
    t0 = time.perf_counter()
    res = Trainer(model_dir, tc, task.train, task.eval, device="cpu").run()
    evals = [{"iterations": e["iterations"], "value": float(e["value"])} for e in res.evaluations]
    run = Run(prompt, cfg.max_iterations, False, evals, float(res.value), time.perf_counter() - t0)
    if target is not None:
        run.reached = res.termination_reason == Reason.TARGET_REACHED
        run.ita = res.iterations if run.reached else cfg.max_iterations
    return run


def ita_post_hoc(run: Run, target: float, budget: int) -> Run:
    """ITA of a run made without a target: the first evaluation at or below it (the Trainer's rule)."""
    hit = next((e["iterations"] for e in run.evaluations if e["value"] <= target), None)
    return replace(run, ita=hit if hit is not None else budget, reached=hit is not None)


def _finite(x: Any) -> Any:
    """NaN/inf → None, recursively: the JSON must be strict (NaN is not JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------- run
def run(cfg: BenchConfig, json_path: Path | None = None, plot_path: Path | None = None) -> dict[str, Any]:
    import torch

    from elastune_demo import tasks as T
    from elastune_demo.bank_candidates import default_candidates
    from elastune_demo.bank_model import ensure_bank_model
    from elastune_demo.build import ensure_tiny_model
    from elastune_worker.bank.features import FeatureExtractor
    from elastune_worker.bank.lookup import lookup, predict_lookup_seconds
    from elastune_worker.bank.score import Scorer
    from elastune_worker.bank.store import PromptBank, build_bank

    torch.set_num_threads(cfg.threads)
    t_start = time.perf_counter()
    _log(f"Prompt Bank bench ({'quick' if cfg.quick else 'full'}): {asdict(cfg)}")
    model_dir = ensure_bank_model(log=True)
    model, tok = _load(model_dir)
    prompts = default_candidates(cfg.n_candidates, cfg.seed)
    specs = _task_specs(cfg)
    ks = cfg.k_values()

    # -- build: K = k_pick through the public API (saved, reloaded: what a restart sees)
    extractor = FeatureExtractor(model, tok)
    with tempfile.TemporaryDirectory(prefix="elastune-bank-bench-") as tmp:
        built = build_bank(model_dir, Path(tmp) / "bank", prompts, cfg.k_pick, cfg.seed, extractor=extractor)
        bank_pick = PromptBank.load(built.path)
    if bank_pick.prompts != built.prompts or not np.array_equal(bank_pick.labels, built.labels):
        raise RuntimeError("the saved bank does not read back as built")
    feats = bank_pick.features
    banks = {
        k: (bank_pick if k == cfg.k_pick else _make_bank(prompts, feats, k, cfg.seed, bank_pick.meta))
        for k in ks
    }
    # Plain FasterPAM clusters (nearest medoid, no size cap), evaluated from the score tables only.
    plain = {k: _make_bank(prompts, feats, k, cfg.seed, bank_pick.meta, balanced=False) for k in ks}
    unbalanced: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
    b = built.meta.build
    _log(
        f"bank: C={len(prompts)} candidates, feature dim {feats.shape[1]}, build {b['seconds']:.1f} s "
        f"(features {b['feature_seconds']:.1f} s, FasterPAM {b['cluster_seconds']:.1f} s), "
        f"cluster sizes at K={cfg.k_pick}: {bank_pick.describe()['cluster_size']}"
    )
    sim = similarity_stats(feats)
    _log(
        f"(c) cosine similarity to the nearest other candidate: median {sim['top1']['p50']:.3f} "
        f"(p5 {sim['top1']['p5']:.3f}); to the 5th nearest: median {sim['top5']['p50']:.3f}"
    )

    default_dir = ensure_tiny_model()
    default_model, default_tok = _load(default_dir)

    rng = random.Random(f"elastune-bank-bench/{cfg.seed}")
    per_task: list[dict[str, Any]] = []
    lookups: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
    for n, spec in enumerate(specs, 1):
        t_task = time.perf_counter()
        task = T.make_task(spec, cfg.n_train, cfg.n_eval, seed=cfg.seed)
        samples = task.eval[: cfg.max_samples]
        own = T.partition_instructions(spec)[0]
        sibling = T.partition_instructions(T.TaskSpec(spec.family, (spec.partition + 1) % 10))[0]
        other_fam = FAMILIES_ORDER[(FAMILIES_ORDER.index(spec.family) + 1) % len(FAMILIES_ORDER)]
        other = T.partition_instructions(T.TaskSpec(other_fam, spec.partition))[0]
        sens = {}
        for name, (m, tk) in {
            "bank_model": (model, tok),
            "default_model": (default_model, default_tok),
        }.items():
            s = Scorer(m, tk, samples, virtual_tokens=cfg.virtual_tokens).score([own, sibling, other])
            sens[name] = {"own": float(s[0]), "sibling": float(s[1]), "other_family": float(s[2])}

        # (b) K = 1: every candidate scored (the brute force), in the same batches as a lookup
        scorer = Scorer(model, tok, samples, virtual_tokens=cfg.virtual_tokens, batch_rows=cfg.batch_rows)
        t0 = time.perf_counter()
        scores = scorer.score(prompts)
        t_brute = time.perf_counter() - t0
        brute = int(np.argmin(scores))
        lookups[1].append(
            {
                "evaluations": len(prompts),
                "latency_s": t_brute,
                "predicted_s": predict_lookup_seconds(banks[1], scorer.n_samples),
                "regret": 0.0,
                "rank": 1,
            }
        )
        for k in ks:
            idx, evals = _simulated_pick(plain[k], scores)
            unbalanced[k].append({"evaluations": evals, "regret": float(scores[idx] - scores[brute])})
        picks: dict[int, Any] = {}
        for k in ks:
            if k == 1:
                continue
            res = lookup(
                banks[k],
                model,
                tok,
                samples,
                cfg.max_samples,
                cfg.batch_rows,
                virtual_tokens=cfg.virtual_tokens,
            )
            sim_idx, sim_evals = _simulated_pick(banks[k], scores)
            picked = prompts.index(res.prompt)
            lookups[k].append(
                {
                    "evaluations": res.evaluations,
                    "latency_s": res.latency_s,
                    "predicted_s": predict_lookup_seconds(banks[k], res.n_samples),
                    "regret": float(scores[picked] - scores[brute]),
                    "rank": int((scores < scores[picked]).sum()) + 1,
                    "consistent": picked == sim_idx and res.evaluations == sim_evals,
                }
            )
            picks[k] = res
        pick = picks[cfg.k_pick]
        induced = induction_prompt(model, tok, task.train[: cfg.demos])

        # (a) ITA: random runs first (no target: their mean final loss defines it), then the others
        rand_idx = rng.sample(range(len(prompts)), cfg.random_inits)
        rand_runs = [tune(model_dir, task, prompts[i], cfg, None) for i in rand_idx]
        target = float(np.mean([r.final for r in rand_runs]))
        rand_runs = [ita_post_hoc(r, target, cfg.max_iterations) for r in rand_runs]
        cache: dict[str, Run] = {}
        for p in (pick.prompt, prompts[brute], induced):
            if p not in cache:
                cache[p] = tune(model_dir, task, p, cfg, target)
        row = {
            "task": spec.name,
            "own_instruction": own,
            "sensitivity": sens,
            "target_loss": target,
            "bank": {
                "prompt": pick.prompt,
                "score": pick.score,
                "evaluations": pick.evaluations,
                "latency_s": pick.latency_s,
                "cluster_size": pick.cluster_size,
                "ita": cache[pick.prompt].ita,
                "reached": cache[pick.prompt].reached,
            },
            "brute_force": {
                "prompt": prompts[brute],
                "score": float(scores[brute]),
                "evaluations": len(prompts),
                "latency_s": t_brute,
                "ita": cache[prompts[brute]].ita,
                "reached": cache[prompts[brute]].reached,
            },
            "induction": {
                "prompt": induced,
                "score": float(scorer.score([induced])[0]),
                "ita": cache[induced].ita,
                "reached": cache[induced].reached,
            },
            "random": {
                "prompts": [r.prompt for r in rand_runs],
                "scores": [float(scores[i]) for i in rand_idx],
                "itas": [r.ita for r in rand_runs],
                "reached": [r.reached for r in rand_runs],
                "ita": _median([r.ita for r in rand_runs]),
            },
            "seconds": 0.0,
        }
        row["seconds"] = round(time.perf_counter() - t_task, 1)
        per_task.append(row)
        _log(
            f"[{n:2d}/{len(specs)}] {spec.name:12s} target {target:.3f} | ITA bank {row['bank']['ita']:3d} "
            f"brute {row['brute_force']['ita']:3d} induction {row['induction']['ita']:3d} "
            f"random {row['random']['ita']:5.1f} {row['random']['itas']} | lookup {pick.evaluations} evals "
            f"{pick.latency_s:.2f} s vs brute {len(prompts)} evals {t_brute:.1f} s | {row['seconds']:.0f} s"
        )
        _log(
            f"      bank: {pick.prompt!r} ({pick.score:.3f})  brute: {prompts[brute]!r} ({scores[brute]:.3f})"
        )
        _log(f"      induction: {induced!r} ({row['induction']['score']:.3f})  own: {own!r}")

    control = (
        _control_default_model(cfg, default_dir, default_model, default_tok, prompts, specs)
        if cfg.control_tasks
        else None
    )
    report = _summarise(cfg, ks, per_task, lookups, sim, bank_pick, control, time.perf_counter() - t_start)
    report["lookup_unbalanced_simulated"] = {
        str(k): {
            "evaluations": _median([x["evaluations"] for x in v]),
            "evaluations_max": max(x["evaluations"] for x in v),
            "score_regret_median": _median([x["regret"] for x in v]),
            "score_regret_mean": float(np.mean([x["regret"] for x in v])),
        }
        for k, v in unbalanced.items()
    }
    for k in ks:
        report["lookup"][str(k)]["score_regret_mean"] = float(np.mean([x["regret"] for x in lookups[k]]))
    _print_summary(report)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        clean = _finite({k: v for k, v in report.items() if not k.startswith("_")})
        json_path.write_text(json.dumps(clean, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
        _log(f"wrote {json_path}")
    if plot_path is not None:
        _plot(report, plot_path)
        _log(f"wrote {plot_path}")
    return report


def _control_default_model(
    cfg: BenchConfig, default_dir: Path, model: Any, tok: Any, prompts: list[str], specs: list[Any]
) -> dict[str, Any]:
    """The same pipeline on the default tiny model for a few tasks: is there prompt sensitivity?"""
    from elastune_demo import tasks as T
    from elastune_worker.bank.features import FeatureExtractor
    from elastune_worker.bank.lookup import lookup
    from elastune_worker.bank.store import build_bank

    _log(f"control: the default tiny model on {cfg.control_tasks} tasks (bank pick vs random, same tuning)")
    with tempfile.TemporaryDirectory(prefix="elastune-bank-bench-default-") as tmp:
        bank = build_bank(
            default_dir,
            Path(tmp) / "bank",
            prompts,
            cfg.k_pick,
            cfg.seed,
            extractor=FeatureExtractor(model, tok),
            calibrate=False,
        )
    rng = random.Random(f"elastune-bank-bench/control/{cfg.seed}")
    step = max(1, len(specs) // cfg.control_tasks)
    rows = []
    for spec in specs[::step][: cfg.control_tasks]:
        task = T.make_task(spec, cfg.n_train, cfg.n_eval, seed=cfg.seed)
        res = lookup(
            bank,
            model,
            tok,
            task.eval[: cfg.max_samples],
            cfg.max_samples,
            cfg.batch_rows,
            virtual_tokens=cfg.virtual_tokens,
        )
        rand = [
            tune(default_dir, task, prompts[i], cfg, None)
            for i in rng.sample(range(len(prompts)), cfg.random_inits)
        ]
        target = float(np.mean([r.final for r in rand]))
        rand = [ita_post_hoc(r, target, cfg.max_iterations) for r in rand]
        b = tune(default_dir, task, res.prompt, cfg, target)
        rows.append(
            {
                "task": spec.name,
                "bank": b.ita,
                "random": _median([r.ita for r in rand]),
                "random_itas": [r.ita for r in rand],
                "target_loss": target,
            }
        )
        _log(f"  control {spec.name}: ITA bank {b.ita} random {rows[-1]['random']} {rows[-1]['random_itas']}")
    med_b, med_r = _median([r["bank"] for r in rows]), _median([r["random"] for r in rows])
    return {"tasks": rows, "bank_median": med_b, "random_median": med_r, "random_over_bank": med_r / med_b}


def _summarise(
    cfg: BenchConfig,
    ks: list[int],
    rows: list[dict[str, Any]],
    lookups: dict[int, list[dict[str, Any]]],
    sim: dict[str, Any],
    bank: Any,
    control: dict[str, Any] | None,
    seconds: float,
) -> dict[str, Any]:
    c = cfg.n_candidates
    lk: dict[str, Any] = {}
    brute_lat = _median([x["latency_s"] for x in lookups[1]])
    for k in ks:
        xs = lookups[k]
        lat = _median([x["latency_s"] for x in xs])
        ev = _median([x["evaluations"] for x in xs])
        lk[str(k)] = {
            "evaluations": ev,
            "evaluations_max": max(x["evaluations"] for x in xs),
            "latency_s": lat,
            "bound_k_plus_c_over_k": k + c / k,
            "speedup_vs_brute_force": brute_lat / lat if lat else math.nan,
            "evaluation_ratio_vs_brute_force": c / ev if ev else math.nan,
            "score_regret_median": _median([x["regret"] for x in xs]),
            "pick_rank_median": _median([x["rank"] for x in xs]),
            "predicted_s_median": _median([x.get("predicted_s", math.nan) for x in xs]),
            "consistent_with_score_table": all(x.get("consistent", True) for x in xs),
        }
    ita: dict[str, Any] = {}
    for m in ("bank", "random", "brute_force", "induction"):
        vals = [r[m]["ita"] for r in rows]
        reached = [all(r[m]["reached"]) if m == "random" else r[m]["reached"] for r in rows]
        ita[m] = {
            "median": _median(vals),
            "mean": float(np.mean(vals)),
            "per_task": vals,
            "tasks_all_reached": int(sum(reached)),
        }
    rel_bank_brute = [r["bank"]["ita"] / r["brute_force"]["ita"] for r in rows]
    rel_random_bank = [r["random"]["ita"] / r["bank"]["ita"] for r in rows]
    rel_induction_bank = [r["induction"]["ita"] / r["bank"]["ita"] for r in rows]
    kp = str(cfg.k_pick)
    ratios = {
        "random_over_bank_ita_of_medians": ita["random"]["median"] / ita["bank"]["median"],
        "random_over_bank_ita_median_per_task": _median(rel_random_bank),
        "bank_over_brute_ita_of_medians": ita["bank"]["median"] / ita["brute_force"]["median"],
        "bank_over_brute_ita_median_per_task": _median(rel_bank_brute),
        "induction_over_bank_ita_of_medians": ita["induction"]["median"] / ita["bank"]["median"],
        "induction_over_bank_ita_median_per_task": _median(rel_induction_bank),
        "brute_over_bank_evaluations": c / lk[kp]["evaluations"],
        "brute_over_bank_latency": lk[kp]["speedup_vs_brute_force"],
    }
    checks = {
        "evaluations_within_k_plus_c_over_k (median)": lk[kp]["evaluations"] <= cfg.k_pick + c / cfg.k_pick,
        "evaluations_within_k_plus_c_over_k (every task)": lk[kp]["evaluations_max"]
        <= cfg.k_pick + c / cfg.k_pick,
        "lookup_20x_faster_than_brute_force": lk[kp]["speedup_vs_brute_force"] >= 20,
        "bank_ita_within_10pct_of_brute_force (median per task)": ratios[
            "bank_over_brute_ita_median_per_task"
        ]
        <= 1.1,
        "bank_ita_within_10pct_of_brute_force (ratio of medians)": ratios["bank_over_brute_ita_of_medians"]
        <= 1.1,
        "bank_1.5x_fewer_iterations_than_random (median per task)": ratios[
            "random_over_bank_ita_median_per_task"
        ]
        >= 1.5,
        "bank_1.5x_fewer_iterations_than_random (ratio of medians)": ratios["random_over_bank_ita_of_medians"]
        >= 1.5,
    }
    sens = {
        m: {
            key: _median([r["sensitivity"][m][key] for r in rows])
            for key in ("own", "sibling", "other_family")
        }
        for m in ("bank_model", "default_model")
    }
    return {
        "config": asdict(cfg),
        "bank": bank.describe() | {"build": bank.meta.build},
        "sensitivity": sens,
        "similarity": {"top1": sim["top1"], "top5": sim["top5"]},
        "lookup": lk,
        "ita": ita,
        "ratios": ratios,
        "checks": checks,
        "control_default_model": control,
        "tasks": rows,
        "seconds": round(seconds, 1),
        "_sim": sim,
        "_lookups": {str(k): v for k, v in lookups.items()},
    }


def _print_summary(r: dict[str, Any]) -> None:
    cfg = r["config"]
    _log("")
    _log(f"== Prompt Bank bench: {len(r['tasks'])} tasks, C = {cfg['n_candidates']}, {r['seconds']:.0f} s ==")
    s = r["sensitivity"]
    for m in ("bank_model", "default_model"):
        _log(
            f"prompt sensitivity, {m:13s}: median score(own instruction) {s[m]['own']:.3f}, sibling task's "
            f"{s[m]['sibling']:.3f}, other family's {s[m]['other_family']:.3f}"
        )
    _log("(b) lookup over the candidates, median over tasks:")
    head = ("K", "evals", "max", "K+C/K", "latency s", "speedup", "regret", "rank")
    _log("    " + " ".join(f"{h:>{w}s}" for h, w in zip(head, (5, 7, 6, 7, 10, 8, 8, 5), strict=True)))
    for k, x in r["lookup"].items():
        _log(
            f"    {k:>5s} {x['evaluations']:7.0f} {x['evaluations_max']:6d} "
            f"{x['bound_k_plus_c_over_k']:7.1f} {x['latency_s']:10.3f} {x['speedup_vs_brute_force']:7.1f}× "
            f"{x['score_regret_median']:8.4f} {x['pick_rank_median']:5.0f}"
        )
    ub = r.get("lookup_unbalanced_simulated", {})
    if ub:
        _log(
            "    plain FasterPAM clusters (no size cap), from the same score tables: "
            + ", ".join(
                f"K={k}: {x['evaluations']:.0f} evals (max {x['evaluations_max']}), "
                f"regret {x['score_regret_median']:.4f}"
                for k, x in ub.items()
            )
        )
    _log("(a) iterations to the target loss, median over tasks (per task in the JSON):")
    for m, x in r["ita"].items():
        _log(
            f"    {m:12s} median {x['median']:5.1f}  mean {x['mean']:5.1f}  "
            f"tasks where every run reached the target {x['tasks_all_reached']}"
        )
    _log("ratios measured in this run:")
    for k, v in r["ratios"].items():
        _log(f"    {k:42s} {v:6.2f}")
    c = r["control_default_model"]
    if c:
        _log(
            f"control, default tiny model: ITA bank {c['bank_median']:.1f} vs random "
            f"{c['random_median']:.1f} (random/bank {c['random_over_bank']:.2f}) on {len(c['tasks'])} tasks"
        )
    _log(
        f"(c) top-1 cosine similarity median {r['similarity']['top1']['p50']:.3f}, "
        f"top-5 median {r['similarity']['top5']['p50']:.3f}"
    )
    _log(
        "done-when checks:"
        + (
            " (defined for the full run: C = 3,000, ≥ 20 tasks; --quick is indicative)"
            if cfg["quick"]
            else ""
        )
    )
    for k, v in r["checks"].items():
        _log(f"    {'PASS' if v else 'MISS'}  {k}")


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    methods = ("bank", "brute_force", "random", "induction")
    data = [r["ita"][m]["per_task"] for m in methods]
    ax[0, 0].boxplot(data, showmeans=True)
    ax[0, 0].set_xticks(range(1, 5), methods)
    ax[0, 0].set_ylabel("iterations to target loss")
    ax[0, 0].set_title(
        f"(a) ITA over {len(r['tasks'])} tasks (median: "
        + ", ".join(f"{m} {r['ita'][m]['median']:.0f}" for m in methods)
        + ")",
        fontsize=9,
    )
    ks = list(r["lookup"])
    ev = [r["lookup"][k]["evaluations"] for k in ks]
    lat = [r["lookup"][k]["latency_s"] for k in ks]
    a = ax[0, 1]
    a.bar(range(len(ks)), ev, color="tab:blue", alpha=0.6, label="evaluations")
    a.set_yscale("log")
    a.set_xticks(range(len(ks)), [f"K={k}" for k in ks])
    a.set_ylabel("evaluations (median)")
    a2 = a.twinx()
    a2.plot(range(len(ks)), lat, "o-", color="tab:red", label="latency")
    a2.set_yscale("log")
    a2.set_ylabel("latency s (median)")
    a.set_title(f"(b) lookup cost over C = {r['config']['n_candidates']} candidates", fontsize=9)
    sim = r["_sim"]
    for key, style in (("_top1", "-"), ("_top5", "--")):
        x = np.sort(sim[key])
        ax[1, 0].plot(x, np.arange(1, len(x) + 1) / len(x), style, label=key[1:])
    ax[1, 0].set_xlabel("cosine similarity of activation features")
    ax[1, 0].set_ylabel("CDF")
    ax[1, 0].legend()
    ax[1, 0].set_title("(c) top-1 / top-5 similarity between candidates", fontsize=9)
    rel_brute = [t["brute_force"]["ita"] / t["bank"]["ita"] for t in r["tasks"]]
    rel_rand = [t["random"]["ita"] / t["bank"]["ita"] for t in r["tasks"]]
    rel_ind = [t["induction"]["ita"] / t["bank"]["ita"] for t in r["tasks"]]
    for vals, label in (
        (rel_brute, "brute force / bank"),
        (rel_rand, "random / bank"),
        (rel_ind, "induction / bank"),
    ):
        x = np.sort(vals)
        ax[1, 1].plot(x, np.arange(1, len(x) + 1) / len(x), label=label)
    ax[1, 1].axvline(1.0, color="gray", lw=0.8)
    ax[1, 1].set_xscale("log")
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10]
    ax[1, 1].set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax[1, 1].minorticks_off()
    ax[1, 1].set_xlabel("ITA ratio (> 1: the bank's pick is faster)")
    ax[1, 1].set_ylabel("CDF over tasks")
    ax[1, 1].legend()
    ax[1, 1].set_title("relative ITA per task (Fig. 9)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see elastune_demo/build.py)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(prog="elastune bench bank", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 tasks, 1,000 candidates, fewer runs (~4 min)")
    p.add_argument("--json", type=Path, metavar="PATH")
    p.add_argument("--plot", type=Path, metavar="PATH")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default 1)")
    p.add_argument("--tasks", help="comma-separated task names instead of the default selection")
    args = p.parse_args(argv)
    cfg = BenchConfig.make(args.quick)
    if args.threads:
        cfg = replace(cfg, threads=args.threads)
    if args.tasks:
        cfg = replace(cfg, tasks=tuple(args.tasks.split(",")))
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    run(cfg, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
