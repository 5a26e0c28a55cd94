"""Build SSJF's output-length predictor offline and cache it like the demo's tiny models
(``elastune_demo/build.py``).

    python -m elastune_ssjf.build [--force] [--out DIR] [--cache-dir DIR] [--dataset FILE]

Training data: the ShareGPT sample the repository ships (``data/sharegpt_250.json.gz``, found by
``elastune_common.datasets``; ``--dataset`` or ``$ELASTUNE_DATASET`` name another copy): each entry's
``prompt`` and ``response_length`` (the output length in tokens that the head learns). A fixed-seed
80/20 split (``numpy.random.default_rng(seed).permutation``): the head is trained on the 200 training
prompts only, and ``build_info.json`` reports on the 50 held-out ones its MAE in tokens, Spearman's rank
correlation, and the trivial baseline (every prompt gets the training median), plus 5-fold
cross-validation on the training split (what the recipe was chosen with; the held-out split was not
used to choose). ``dataset_predictions.json`` holds out-of-fold predictions for every entry (5 folds
over the whole dataset, each predicted by a head that never saw it): what ``elastune bench ssjf`` feeds
the scheduler, so no request is scheduled on an in-sample prediction.

The artifact is ``<ELASTUNE_CACHE | ~/.cache/elastune>/models/ssjf-predictor-v1``: the head's weights
(the encoder stays in its package; build_info.json pins its version and weights digest, and a
different encoder makes the cache stale). Built in a temp dir and renamed into place under a lock, as
the tiny models are. About 20 s on 2 cores: one frozen forward of 250 prompts, then 11 small heads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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


def default_dataset() -> Path:
    """The ShareGPT sample every reader defaults to (``$ELASTUNE_DATASET`` overrides it for all)."""
    return datasets.sharegpt_path()


def load_dataset(path: Path | None = None) -> list[Entry]:
    path = Path(path) if path is not None else default_dataset()
    if not path.exists():
        raise datasets.not_found(path, "SSJF training data", f"--dataset or ${datasets.DATASET_ENV}")
    data = datasets.read_json(path)
    entries = data["entries"] if isinstance(data, dict) else data
    return [Entry(e["prompt"], int(e["response_length"]), float(e.get("arrival_time", 0.0))) for e in entries]


def split(n: int, spec: PredictorSpec) -> tuple[list[int], list[int]]:
    """(train, test) indices: a fixed-seed permutation, the last ``test_fraction`` held out."""
    import numpy as np

    perm = [int(i) for i in np.random.default_rng(spec.seed).permutation(n)]
    n_train = round(n * (1 - spec.test_fraction))
    return perm[:n_train], perm[n_train:]


def folds_of(indices: Sequence[int], k: int) -> list[list[int]]:
    """``k`` contiguous, nearly equal parts (numpy.array_split's sizes)."""
    q, r = divmod(len(indices), k)
    out, start = [], 0
    for f in range(k):
        size = q + (1 if f < r else 0)
        out.append(list(indices[start : start + size]))
        start += size
    return out


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
def train_head(x: Any, targets: Sequence[int], spec: PredictorSpec, seed: int) -> Any:
    """The regression head with L1 loss on ``x`` (n, dim) features: full-batch AdamW."""
    import torch

    from .predictor import LengthHead

    torch.manual_seed(seed)
    head = LengthHead(x.shape[1], spec)
    head.mean.copy_(x.mean(0))
    head.std.copy_(x.std(0) + 1e-6)
    t = torch.tensor([v / spec.target_scale for v in targets], dtype=torch.float32)
    out = head.net[-1]
    assert isinstance(out, torch.nn.Linear)
    with torch.no_grad():
        out.bias.fill_(statistics.median(t.tolist()))  # start at the median: L1's constant fit
    opt = torch.optim.AdamW(head.net.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    head.train()
    for _ in range(spec.epochs):
        loss = (head(x) - t).abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return head.eval()


def predict_with(head: Any, x: Any, spec: PredictorSpec) -> list[int]:
    import torch

    from .predictor import to_tokens

    with torch.inference_mode():
        return to_tokens(head(x), spec)


def cross_fit(x: Any, y: Sequence[int], parts: list[list[int]], spec: PredictorSpec) -> dict[int, int]:
    """Each part predicted by a head trained on the other parts: {index: tokens}."""
    out: dict[int, int] = {}
    for f, part in enumerate(parts):
        rest = [i for g, other in enumerate(parts) if g != f for i in other]
        head = train_head(x[rest], [y[i] for i in rest], spec, spec.seed + f)
        out.update(zip(part, predict_with(head, x[part], spec), strict=True))
    return out


def _write_artifact(out: Path, spec: PredictorSpec, dataset: Path, *, log: bool) -> dict[str, Any]:
    import numpy as np
    import safetensors
    import torch
    import transformers
    from safetensors.torch import save_file

    from .predictor import Encoder

    t0 = time.perf_counter()
    entries = load_dataset(dataset)
    y = [e.response_length for e in entries]
    encoder = Encoder(spec)
    x = encoder.features([e.prompt for e in entries])
    t_features = time.perf_counter() - t0
    if log:
        print(f"  encoded {len(entries)} prompts in {t_features:.1f} s", flush=True)

    train, test = split(len(entries), spec)
    head = train_head(x[train], [y[i] for i in train], spec, spec.seed)
    test_pred = predict_with(head, x[test], spec)
    cv = cross_fit(x, y, folds_of(train, spec.folds), spec)
    train_y = [y[i] for i in train]
    oof_order = [int(i) for i in np.random.default_rng(spec.seed + 1).permutation(len(entries))]
    oof = cross_fit(x, y, folds_of(oof_order, spec.folds), spec)
    metrics = {
        "test": scores(test_pred, [y[i] for i in test], train_y),
        "cv_train": scores([cv[i] for i in train], train_y, train_y),
        "out_of_fold": scores([oof[i] for i in range(len(y))], y, y),
    }
    # The baselines of cv_train / out_of_fold use the whole set's median (a touch optimistic for them).
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / HEAD_FILE))
    digest = hashlib.sha256(datasets.read_bytes(dataset)).hexdigest()  # the data's, not the gzip's
    (out / PREDICTIONS_FILE).write_text(
        json.dumps(
            {
                "dataset_sha256": digest,
                "split": {"train": train, "test": test},
                "out_of_fold": [oof[i] for i in range(len(y))],
                "test": dict(zip(map(str, test), test_pred, strict=True)),
            }
        )
        + "\n"
    )
    return {
        "name": MODEL_NAME,
        "format_version": FORMAT_VERSION,
        "spec": spec.fingerprint(),
        "encoder": encoder_identity(encoder.path),
        "dataset": {"name": spec.dataset, "path": str(dataset), "sha256": digest, "entries": len(entries)},
        "metrics": metrics,
        "head_params": sum(p.numel() for p in head.net.parameters()),
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
    """The predictor's directory, built first if missing (~20 s on 2 cores)."""
    return build_predictor(model_dir(cache_dir, spec), spec, dataset=dataset, force=force, log=log)


def summary(info: dict[str, Any]) -> str:
    t = info.get("metrics", {}).get("test", {})
    cv = info.get("metrics", {}).get("cv_train", {})
    return (
        f"held-out ({t.get('n')} prompts): MAE {t.get('mae_tokens')} tokens, Spearman {t.get('spearman')}, "
        f"baseline (training median {t.get('baseline_median_tokens')}) MAE {t.get('baseline_mae_tokens')}; "
        f"{info.get('spec', {}).get('folds')}-fold CV on the training split: MAE {cv.get('mae_tokens')}, "
        f"Spearman {cv.get('spearman')}, baseline MAE {cv.get('baseline_mae_tokens')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_ssjf.build", description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="rebuild even if a complete artifact exists")
    p.add_argument("--out", type=Path, help="exact output directory (default: the cache location)")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $ELASTUNE_CACHE or ~/.cache/elastune)")
    p.add_argument("--dataset", type=Path, help="training data (default: data/sharegpt_250.json.gz)")
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
