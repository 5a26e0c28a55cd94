"""Build SSJF's output-length predictor offline and cache it like the demo's tiny models
(``elastune_demo/build.py``).

    python -m elastune_ssjf.build [--force] [--out DIR] [--cache-dir DIR] [--dataset FILE]

Training data, all shipped in ``data/`` (found by ``elastune_common.datasets``): the ShareGPT sample
(``sharegpt_250.json.gz``; ``--dataset`` or ``$ELASTUNE_DATASET`` name another copy) and AlpacaEval's
instructions answered by gpt-3.5-turbo-0301 (``alpacaeval_gpt35_0301.json.gz``), each entry's ``prompt``
and ``response_length`` (the output tokens the head learns). The split is by source, not by record: one
whole source, ``spec.held_out_source`` (AlpacaEval's Self-Instruct set, 252 prompts), never reaches
training, and build_info.json's ``test`` figures (MAE in tokens, Spearman's rank correlation, and the
median predictor: every prompt gets the training median) are measured on it alone; ``loso`` holds
leave-one-source-out cross-validation over the training sources (each predicted by a head that never saw
any of its prompts). ``dataset_predictions.json`` records each side's prompt digests (a prompt on both
sides fails the build) and the held-out source's predictions.

The artifact is ``<ELASTUNE_CACHE | ~/.cache/elastune>/models/ssjf-predictor-v1``: the head's weights
(the encoder stays in its package; build_info.json pins its version and weights digest, and a
different encoder makes the cache stale). Built in a temp dir and renamed into place under a lock, as
the tiny models are. About a minute on 2 cores: one frozen forward of 1,055 prompts, then closed-form
heads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastune_common import datasets
from elastune_worker.model_cache import build_atomically, cache_root

from .predictor import (
    DEFAULT_SPEC,
    FORMAT_VERSION,
    HEAD_FILE,
    INFO_FILE,
    MODEL_NAME,
    PREDICTIONS_FILE,
    PredictorSpec,
    encoder_identity,
)


# -------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Entry:
    prompt: str
    response_length: int
    """Output tokens of the recorded answer: the target."""
    arrival_time: float
    """Seconds from the trace's start (Poisson arrivals in sharegpt_250)."""
    source: str = "sharegpt"
    """Where the prompt comes from (an entry's ``source``; ShareGPT's entries have none)."""


def default_dataset() -> Path:
    """The ShareGPT sample every reader defaults to (``$ELASTUNE_DATASET`` overrides it for all)."""
    return datasets.sharegpt_path()


def load_dataset(path: Path | None = None) -> list[Entry]:
    path = Path(path) if path is not None else default_dataset()
    if not path.exists():
        raise datasets.not_found(path, "SSJF training data", f"--dataset or ${datasets.DATASET_ENV}")
    data = datasets.read_json(path)
    entries = data["entries"] if isinstance(data, dict) else data
    return [
        Entry(
            e["prompt"],
            int(e["response_length"]),
            float(e.get("arrival_time", 0.0)),
            e.get("source", "sharegpt"),
        )
        for e in entries
    ]


def training_entries(dataset: Path | None = None) -> list[Entry]:
    """Every entry the build sees, both sides of the split: the ShareGPT sample, then AlpacaEval's."""
    path = datasets.alpacaeval_path()
    if not path.exists():
        raise datasets.not_found(path, "SSJF training data", "a checkout's data/")
    return load_dataset(dataset) + load_dataset(path)


def prompt_digest(prompt: str) -> str:
    """What names a record across sources: its prompt, whitespace-normalised."""
    return hashlib.sha256(" ".join(prompt.split()).encode()).hexdigest()[:16]


def split_by_source(entries: Sequence[Entry], held_out: str) -> tuple[list[int], list[int]]:
    """(train, test) indices: every entry of ``held_out`` tested, none trained on; a test prompt that also
    occurs among the training entries (the same question in two sources) is an error, not a test."""
    train = [i for i, e in enumerate(entries) if e.source != held_out]
    test = [i for i, e in enumerate(entries) if e.source == held_out]
    if not test:
        raise ValueError(f"no entry of the held-out source {held_out!r}")
    seen = {prompt_digest(entries[i].prompt) for i in train}
    leaked = [i for i in test if prompt_digest(entries[i].prompt) in seen]
    if leaked:
        raise ValueError(
            f"{len(leaked)} held-out prompt(s) of {held_out!r} also occur in training: {leaked[:5]}"
        )
    return train, test


# --------------------------------------------------------------------------------------- metrics
def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2  # ties share their average rank
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson on average ranks); None when either side is constant."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return float(cov / (va * vb) ** 0.5)


def mae(pred: Sequence[float], truth: Sequence[float]) -> float:
    return statistics.fmean(abs(p - t) for p, t in zip(pred, truth, strict=True))


def scores(pred: Sequence[int], truth: Sequence[int], train_truth: Sequence[int]) -> dict[str, Any]:
    median = statistics.median(train_truth)
    rho = spearman(pred, truth)
    return {
        "n": len(truth),
        "mae_tokens": round(mae(pred, truth), 2),
        "spearman": None if rho is None else round(rho, 4),
        "baseline_mae_tokens": round(mae([median] * len(truth), truth), 2),
        "baseline_median_tokens": median,
    }


# -------------------------------------------------------------------------------------- training
def train_head(x: Any, targets: Sequence[int], spec: PredictorSpec) -> Any:
    """The ridge regression of log(tokens) on standardised features, solved in closed form."""
    import torch

    from .predictor import LengthHead

    head = LengthHead(x.shape[1], spec)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0) + 1e-6)
    z = (x - head.mean) / head.std
    t = torch.tensor([math.log(max(1, v)) for v in targets], dtype=torch.float64)
    zd = z.double()
    gram = zd.T @ zd + spec.ridge_alpha * torch.eye(z.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(gram, zd.T @ (t - t.mean()))
    with torch.no_grad():
        head.linear.weight.copy_(w.float().unsqueeze(0))
        head.linear.bias.fill_(float(t.mean()))  # z is centred: the intercept is the mean log length
    return head.eval()


def predict_with(head: Any, x: Any, spec: PredictorSpec) -> list[int]:
    import torch

    from .predictor import to_tokens

    with torch.inference_mode():
        return to_tokens(head(x), spec)


def leave_one_source_out(x: Any, entries: Sequence[Entry], train: Sequence[int], spec: PredictorSpec) -> dict:
    """Each training source predicted by a head trained on the other training sources."""
    out: dict[str, Any] = {}
    for source in sorted({entries[i].source for i in train}):
        fit = [i for i in train if entries[i].source != source]
        part = [i for i in train if entries[i].source == source]
        head = train_head(x[fit], [entries[i].response_length for i in fit], spec)
        pred = predict_with(head, x[part], spec)
        out[source] = scores(
            pred, [entries[i].response_length for i in part], [entries[i].response_length for i in fit]
        )
    rhos = [m["spearman"] for m in out.values() if m["spearman"] is not None]
    out["mean_spearman"] = round(statistics.fmean(rhos), 4) if rhos else None
    return out


def _counts(entries: Sequence[Entry], idx: Sequence[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in idx:
        out[entries[i].source] = out.get(entries[i].source, 0) + 1
    return dict(sorted(out.items()))


def _write_artifact(out: Path, spec: PredictorSpec, dataset: Path, *, log: bool) -> dict[str, Any]:
    import safetensors
    import torch
    import transformers
    from safetensors.torch import save_file

    from .predictor import Encoder

    t0 = time.perf_counter()
    entries = training_entries(dataset)
    y = [e.response_length for e in entries]
    train, test = split_by_source(entries, spec.held_out_source)  # before the costly encoding
    encoder = Encoder(spec)
    x = encoder.features([e.prompt for e in entries])
    t_features = time.perf_counter() - t0
    if log:
        print(f"  encoded {len(entries)} prompts in {t_features:.1f} s", flush=True)

    head = train_head(x[train], [y[i] for i in train], spec)
    test_pred = predict_with(head, x[test], spec)
    train_y = [y[i] for i in train]
    metrics = {
        "test": scores(test_pred, [y[i] for i in test], train_y),
        "loso": leave_one_source_out(x, entries, train, spec),
    }
    split_info = {
        "train_sources": _counts(entries, train),
        "held_out_sources": _counts(entries, test),
    }
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / HEAD_FILE))
    files = [Path(dataset), datasets.alpacaeval_path()]
    digests = {f.name: hashlib.sha256(datasets.read_bytes(f)).hexdigest() for f in files}  # the data's
    (out / PREDICTIONS_FILE).write_text(
        json.dumps(
            {
                "datasets_sha256": digests,
                "split": {
                    **split_info,
                    "train_prompts": sorted({prompt_digest(entries[i].prompt) for i in train}),
                    "held_out_prompts": [prompt_digest(entries[i].prompt) for i in test],
                },
                "held_out": test_pred,
            }
        )
        + "\n"
    )
    return {
        "name": MODEL_NAME,
        "format_version": FORMAT_VERSION,
        "spec": spec.fingerprint(),
        "encoder": encoder_identity(encoder.path),
        "dataset": {
            "name": spec.dataset,
            "paths": [datasets.display_path(f) for f in files],
            "sha256": digests,
            "entries": len(entries),
        },
        "split": split_info,
        "metrics": metrics,
        "head_params": sum(p.numel() for p in head.linear.parameters()),
        "seconds": round(time.perf_counter() - t0, 2),
        "seconds_features": round(t_features, 2),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# --------------------------------------------------------------------------------------- the cache
def dirname(spec: PredictorSpec = DEFAULT_SPEC) -> str:
    if spec == DEFAULT_SPEC:
        return MODEL_NAME
    digest = hashlib.sha256(json.dumps(spec.fingerprint(), sort_keys=True).encode()).hexdigest()
    return f"{MODEL_NAME}-{digest[:10]}"


def model_dir(cache_dir: Path | None = None, spec: PredictorSpec = DEFAULT_SPEC) -> Path:
    """``<cache root>/models/ssjf-predictor-v1`` (a variant spec gets a digest suffix)."""
    return cache_root(cache_dir) / "models" / dirname(spec)


def read_build_info(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((Path(path) / INFO_FILE).read_text()))
    except (OSError, ValueError):
        return None


def is_complete(path: Path, spec: PredictorSpec = DEFAULT_SPEC) -> bool:
    """build_info.json is written last, so its presence means a whole artifact; it must match the spec
    and the installed encoder."""
    info = read_build_info(path)
    return (
        info is not None
        and info.get("format_version") == FORMAT_VERSION
        and info.get("spec") == spec.fingerprint()
        and info.get("encoder") == encoder_identity()
        and (Path(path) / HEAD_FILE).exists()
    )


def build_predictor(
    out_dir: Path,
    spec: PredictorSpec = DEFAULT_SPEC,
    *,
    dataset: Path | None = None,
    force: bool = False,
    log: bool = False,
) -> Path:
    """Build into exactly ``out_dir`` unless a complete artifact for ``spec`` is already there."""
    if not force and is_complete(Path(out_dir).resolve(), spec):
        return Path(out_dir).resolve()
    dataset = Path(dataset) if dataset is not None else default_dataset()
    load_dataset(dataset)  # a clear error before taking the lock
    return build_atomically(
        out_dir, lambda d: is_complete(d, spec), lambda tmp: _write_artifact(tmp, spec, dataset, log=log),
        force=force, info_file=INFO_FILE,
    )  # fmt: skip


def ensure_predictor(
    cache_dir: Path | None = None,
    *,
    dataset: Path | None = None,
    spec: PredictorSpec = DEFAULT_SPEC,
    force: bool = False,
    log: bool = False,
) -> Path:
    """The predictor's directory, built first if missing (about a minute on 2 cores)."""
    return build_predictor(model_dir(cache_dir, spec), spec, dataset=dataset, force=force, log=log)


def summary(info: dict[str, Any]) -> str:
    t = info.get("metrics", {}).get("test", {})
    loso = info.get("metrics", {}).get("loso", {})
    held = ", ".join(info.get("split", {}).get("held_out_sources", {}))
    return (
        f"held-out source {held} ({t.get('n')} prompts, none trained on): MAE {t.get('mae_tokens')} tokens, "
        f"Spearman {t.get('spearman')}, median predictor (training median {t.get('baseline_median_tokens')}) "
        f"MAE {t.get('baseline_mae_tokens')}; leave-one-source-out Spearman {loso.get('mean_spearman')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_ssjf.build", description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="rebuild even if a complete artifact exists")
    p.add_argument("--out", type=Path, help="exact output directory (default: the cache location)")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $ELASTUNE_CACHE or ~/.cache/elastune)")
    p.add_argument("--dataset", type=Path, help="ShareGPT training data (default: data/sharegpt_250.json.gz)")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see elastune_demo/build.py
    target = args.out if args.out is not None else model_dir(args.cache_dir)
    cached = not args.force and is_complete(target)
    try:
        path = build_predictor(target, dataset=args.dataset, force=args.force, log=not args.quiet)
    except FileNotFoundError as exc:
        print(f"ssjf build: {exc}")
        return 2
    info = read_build_info(path) or {}
    verb = "cached at" if cached else "wrote"
    print(f"{verb} {path} (build {info.get('seconds')} s): {summary(info)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
