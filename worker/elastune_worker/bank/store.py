"""The two-layer structure of the Prompt Bank (PromptTuner §4.3.1, §4.3.3, §5.2), per LLM, on disk.

Layer 1 holds the K medoids (the clusters' representative prompts), layer 2 every candidate with its
cluster. Clusters come from k-medoids (FasterPAM, `kmedoids` package) on the cosine distances of the
candidates' activation features under the bank's LLM; K defaults to 50 (§5.2), √C being the optimum of
the K + C/K lookup cost (§4.3.2).

On disk, one directory per LLM (``bank_dir(llm_key)``): ``features.safetensors`` (the (C, D) float32
tensor) and ``bank.json`` (prompts, cluster labels, medoids, LLM identity, capacity, calibration).
Both are written into a temp directory that is swapped into place whole, so a reader or a restart sees
the old bank or the new one, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from elastune_contract.vocabulary import Reason
from elastune_worker.bank.errors import EMPTY_BANK, NO_FEATURES, BankError
from elastune_worker.bank.features import FEATURE_KIND, FeatureExtractor, cosine_distances, model_fingerprint
from elastune_worker.fsutil import swap_into_place

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_K",
    "FORMAT_VERSION",
    "BankMeta",
    "InsertResult",
    "PromptBank",
    "bank_dir",
    "build_bank",
    "cluster",
    "ensure_bank",
    "load_bank",
]

FORMAT_VERSION = 1
DEFAULT_K = 50  # §5.2: "empirically set the number of clusters … as 50"
DEFAULT_CAPACITY = 3000  # §4.3.3: replacement past "the threshold (e.g., 3000)"
JSON_FILE = "bank.json"
TENSOR_FILE = "features.safetensors"


# ------------------------------------------------------------------------------------- locations
def _cache_root() -> Path:
    env = os.environ.get("ELASTUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "elastune"


def safe_key(llm_key: str) -> str:
    """A directory name for an LLM key (an HF id like ``org/model`` or a path): readable, plus a digest
    so that keys differing only in replaced characters never share a directory."""
    import hashlib

    if not llm_key:
        raise ValueError("empty LLM key")
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", llm_key).strip("._")[-80:] or "llm"
    return f"{readable}-{hashlib.sha256(llm_key.encode()).hexdigest()[:8]}"


def bank_dir(llm_key: str) -> Path:
    """``$ELASTUNE_CACHE`` (default ``~/.cache/elastune``) ``/bank/<safe llm key>``."""
    return _cache_root() / "bank" / safe_key(llm_key)


def default_llm_key(model_dir: str | Path) -> str:
    """The key of a local model directory: its resolved path (two copies of a model are two LLMs)."""
    return str(Path(model_dir).resolve())


# ---------------------------------------------------------------------------------------- types
@dataclass
class BankMeta:
    """Everything in bank.json besides the per-prompt arrays."""

    llm: str
    model_dir: str
    model_fingerprint: str
    feature_kind: str = FEATURE_KIND
    feature_dim: int = 0
    k: int = DEFAULT_K
    k_requested: int = DEFAULT_K
    balanced: bool = True
    capacity: int = DEFAULT_CAPACITY
    seed: int = 0
    # Lookup cost model for the scheduler's latency budget: seconds per (candidate × sample) row.
    seconds_per_row: float = 0.0
    calibration: dict[str, Any] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    inserted: int = 0
    evicted: int = 0


@dataclass(frozen=True)
class InsertResult:
    """What one insertion did. ``inserted`` is False for a duplicate, or when the new prompt itself was
    the member closest to the medoid and so was the one replaced."""

    prompt: str
    inserted: bool
    cluster: int
    medoid: str
    distance: float
    """Cosine distance from the new prompt to its cluster's medoid."""
    evicted: str | None = None
    evicted_distance: float | None = None
    size: int = 0
    """Bank size after the operation."""
    reason: str = Reason.PROMPT_BANK_INSERTED
    """Inserted | Duplicate | Replaced (inserted, another evicted) | Rejected (the new one evicted)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ clustering
def cluster(
    features: np.ndarray, k: int, seed: int = 0, balanced: bool = True
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """FasterPAM medoids on cosine distances, then each prompt's cluster: (labels (C,), medoids (K,), info).

    K is capped at C. ``balanced`` caps every cluster at ⌈C/K⌉ members (see ``capped_assignment``).
    """
    import kmedoids

    n = len(features)
    k = max(1, min(k, n))
    diss = cosine_distances(features, features)
    np.fill_diagonal(diss, 0.0)
    # Random init (the package's default) rather than BUILD: BUILD is O(k·n²) up front (≈ 5 s at
    # n = 3,000) and FasterPAM's eager swaps reach the same loss to < 0.1 % here.
    res = kmedoids.fasterpam(diss, k, max_iter=100, init="random", random_state=seed, n_cpu=1)
    medoids = np.asarray(res.medoids, dtype=np.int64)
    to_medoids = diss[:, medoids]
    cap = math.ceil(n / len(medoids))
    if balanced:
        labels = capped_assignment(to_medoids, medoids, cap)
    else:
        # Nearest medoid (ties → lowest cluster index); each medoid in its own cluster even among
        # exact duplicates.
        labels = np.argmin(to_medoids, axis=1).astype(np.int64)
        labels[medoids] = np.arange(len(medoids))
    moved = int((labels != np.argmin(to_medoids, axis=1)).sum())
    info = {
        "loss": float(res.loss),
        "n_iter": int(res.n_iter),
        "n_swap": int(res.n_swap),
        "balanced": balanced,
        "cap": cap if balanced else None,
        "moved_from_nearest_medoid": moved,
    }
    return labels, medoids, info


def capped_assignment(to_medoids: np.ndarray, medoids: np.ndarray, cap: int) -> np.ndarray:
    """Nearest-medoid assignment under a size cap: (prompt, medoid) pairs in ascending distance, each
    prompt taken by the first medoid that still has room. Medoids keep their own cluster.

    Why (a deliberate addition to the paper): §4.3.2's cost K + C/K assumes equal clusters, but plain
    k-medoids clusters of prompt features are uneven (14–172 members at C = 3,000, K = 50), so a lookup
    landing in a large cluster costs up to 2.0× the bound, and the scheduler's latency budget (§4.4.3)
    needs a cost it can rely on. With a cap of ⌈C/K⌉ every lookup costs at most K + ⌈C/K⌉ − 1
    evaluations; only prompts far from their medoid move (the bench reports the quality either way).
    """
    n, k = to_medoids.shape
    if cap * k < n:
        raise ValueError(f"cap {cap} × {k} clusters cannot hold {n} prompts")
    labels = np.full(n, -1, dtype=np.int64)
    sizes = np.zeros(k, dtype=np.int64)
    labels[medoids] = np.arange(k)
    sizes[:] = 1
    for flat in np.argsort(to_medoids, axis=None, kind="stable"):
        i, c = divmod(int(flat), k)
        if labels[i] < 0 and sizes[c] < cap:
            labels[i] = c
            sizes[c] += 1
    return labels


# -------------------------------------------------------------------------------------- the bank
class PromptBank:
    """Prompts (layer 2) with unit feature rows, a cluster label each, and K medoids (layer 1)."""

    def __init__(
        self,
        prompts: Sequence[str],
        features: np.ndarray,
        labels: np.ndarray,
        medoids: np.ndarray,
        meta: BankMeta,
        path: Path | None = None,
    ) -> None:
        self.prompts = list(prompts)
        self.features = np.asarray(features, dtype=np.float32)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.medoids = np.asarray(medoids, dtype=np.int64)
        self.meta = meta
        self.path = Path(path) if path is not None else None
        self._extractor: FeatureExtractor | None = None
        self._index = {p: i for i, p in enumerate(self.prompts)}
        self._check()

    def _check(self) -> None:
        n = len(self.prompts)
        if self.features.shape[0] != n or self.labels.shape != (n,):
            raise BankError(NO_FEATURES, f"bank arrays disagree: {n} prompts, features {self.features.shape}")
        if len(self._index) != n:
            raise ValueError("duplicate prompts in the bank")
        if n and (self.medoids.min() < 0 or self.medoids.max() >= n):
            raise BankError(NO_FEATURES, "medoid index out of range: the bank files are corrupt")

    # -- views
    def __len__(self) -> int:
        return len(self.prompts)

    def __contains__(self, prompt: object) -> bool:
        return prompt in self._index

    @property
    def k(self) -> int:
        return len(self.medoids)

    @property
    def capacity(self) -> int:
        return self.meta.capacity

    def medoid_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self.medoids]

    def members(self, c: int) -> np.ndarray:
        """Indices of cluster ``c``'s prompts (its medoid included), ascending."""
        return np.flatnonzero(self.labels == c)

    def cluster_sizes(self) -> np.ndarray:
        return np.bincount(self.labels, minlength=self.k)

    def describe(self) -> dict[str, Any]:
        sizes = self.cluster_sizes() if len(self) else np.zeros(0, dtype=np.int64)
        return {
            "llm": self.meta.llm,
            "candidates": len(self),
            "k": self.k,
            "capacity": self.capacity,
            "feature_dim": self.meta.feature_dim,
            "cluster_size": {
                "min": int(sizes.min()) if len(sizes) else 0,
                "median": float(np.median(sizes)) if len(sizes) else 0.0,
                "max": int(sizes.max()) if len(sizes) else 0,
            },
            "seconds_per_row": self.meta.seconds_per_row,
            "inserted": self.meta.inserted,
            "evicted": self.meta.evicted,
            "path": str(self.path) if self.path else None,
        }

    def require_nonempty(self) -> None:
        if not self.prompts or not len(self.medoids):
            raise BankError(EMPTY_BANK, f"the Prompt Bank of {self.meta.llm} holds no candidate prompts")

    # -- insertion & replacement (§4.3.3)
    def attach_extractor(self, extractor: FeatureExtractor) -> None:
        """Use this extractor (the bank's LLM, already loaded) for insertions without a feature."""
        if extractor.dim != self.meta.feature_dim:
            raise BankError(
                NO_FEATURES,
                f"extractor gives {extractor.dim}-dim features, the bank has {self.meta.feature_dim}",
            )
        self._extractor = extractor

    def extractor(self) -> FeatureExtractor:
        if self._extractor is None:
            d = Path(self.meta.model_dir)
            if not d.is_dir():
                raise BankError(NO_FEATURES, f"the bank's LLM {self.meta.llm} is not at {d}: cannot extract")
            if model_fingerprint(d) != self.meta.model_fingerprint:
                raise BankError(NO_FEATURES, f"the LLM at {d} changed since the bank was built: rebuild it")
            self._extractor = FeatureExtractor.from_dir(d)
        return self._extractor

    def insert(self, prompt: str, feature: np.ndarray | None = None) -> InsertResult:
        """Add ``prompt`` to the cluster of its nearest medoid (cosine, no scoring); past the capacity,
        remove that cluster's member closest to its medoid. Call ``save()`` to persist."""
        self.require_nonempty()  # no medoid to join: build the bank first
        if feature is None:
            feature = self.extractor()([prompt])[0]
        return self._insert(prompt, np.asarray(feature, dtype=np.float32).reshape(-1))

    def insert_many(self, prompts: Sequence[str]) -> list[InsertResult]:
        """``insert`` for each prompt in order, with one batched feature extraction."""
        self.require_nonempty()
        feats = self.extractor()(list(prompts))
        return [self._insert(p, f) for p, f in zip(prompts, feats, strict=True)]

    def _insert(self, prompt: str, feature: np.ndarray) -> InsertResult:
        if feature.shape != (self.meta.feature_dim,):
            raise BankError(
                NO_FEATURES, f"feature of shape {feature.shape}, the bank needs ({self.meta.feature_dim},)"
            )
        d_medoids = cosine_distances(feature[None, :], self.features[self.medoids])[0]
        c = int(np.argmin(d_medoids))  # C_sim; ties → lowest cluster index
        medoid = self.prompts[self.medoids[c]]
        if prompt in self._index:  # already a candidate: report where it is, change nothing
            c_old = int(self.labels[self._index[prompt]])
            return InsertResult(
                prompt,
                False,
                c_old,
                self.prompts[self.medoids[c_old]],
                float(d_medoids[c_old]),
                size=len(self),
                reason=Reason.PROMPT_BANK_DUPLICATE,
            )
        self.prompts.append(prompt)
        self._index[prompt] = len(self.prompts) - 1
        self.features = np.vstack([self.features, feature[None, :]])
        self.labels = np.append(self.labels, c)
        self.meta.inserted += 1
        if len(self) <= self.capacity:
            return InsertResult(prompt, True, c, medoid, float(d_medoids[c]), size=len(self))
        victim, dist = self._replacement(c)
        evicted = self.prompts[victim]
        self._remove(victim)
        self.meta.evicted += 1
        kept = evicted != prompt
        return InsertResult(
            prompt,
            kept,
            c,
            medoid,
            float(d_medoids[c]),
            evicted,
            dist,
            len(self),
            "Replaced" if kept else "Rejected",
        )

    def _replacement(self, c: int) -> tuple[int, float]:
        """The member of cluster ``c`` with the minimal cosine distance to its medoid.

        The paper's rule (§4.3.3) does not say whether the medoid itself counts; it is at distance 0, so
        counting it would always remove the representative, which defeats the rule's stated intent
        (keep the cluster diverse) and would leave layer 1 without a prompt for the cluster. We exclude
        it. The new prompt does count: if it is the most redundant member, it is the one dropped. Ties go
        to the oldest member (lowest index), which makes the choice exact and reproducible.
        """
        m = self.medoids[c]
        idx = self.members(c)
        idx = idx[idx != m]
        if not len(idx):  # only the medoid: cannot happen after an insertion into c, guard anyway
            raise RuntimeError(f"cluster {c} has no member besides its medoid")
        d = cosine_distances(self.features[idx], self.features[m][None, :])[:, 0]
        j = int(np.argmin(d))  # argmin returns the first of equal minima: the lowest index
        return int(idx[j]), float(d[j])

    def _remove(self, i: int) -> None:
        if i in set(self.medoids.tolist()):
            raise RuntimeError("a medoid is never removed")
        del self.prompts[i]
        self.features = np.delete(self.features, i, axis=0)
        self.labels = np.delete(self.labels, i)
        self.medoids = np.where(self.medoids > i, self.medoids - 1, self.medoids)
        self._index = {p: j for j, p in enumerate(self.prompts)}

    # -- persistence
    def save(self, path: str | Path | None = None) -> Path:
        """Write bank.json + features.safetensors into ``path`` (default: where it was loaded/built)."""
        from safetensors.numpy import save_file

        out = Path(path) if path is not None else self.path
        if out is None:
            raise ValueError("no path: pass one, or build/load the bank from a directory")
        out = out.resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            save_file({"features": np.ascontiguousarray(self.features)}, str(tmp / TENSOR_FILE))
            doc = {
                "format": FORMAT_VERSION,
                **asdict(self.meta),
                "prompts": self.prompts,
                "labels": self.labels.tolist(),
                "medoids": self.medoids.tolist(),
            }
            (tmp / JSON_FILE).write_text(
                json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
            )
            tmp.chmod(0o755)
            swap_into_place(tmp, out)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        self.path = out
        return out

    @classmethod
    def load(cls, path: str | Path) -> PromptBank:
        """The bank saved in ``path``; BankError(NoFeatures) if there is none (or it is unreadable)."""
        from safetensors.numpy import load_file

        path = Path(path)
        try:
            doc = json.loads((path / JSON_FILE).read_text(encoding="utf-8"))
            features = load_file(str(path / TENSOR_FILE))["features"]
        except FileNotFoundError:
            raise BankError(
                NO_FEATURES, f"no Prompt Bank at {path}: run `elastune bank build` for this LLM first"
            ) from None
        except (OSError, ValueError, KeyError) as exc:
            raise BankError(NO_FEATURES, f"unreadable Prompt Bank at {path} ({exc}); rebuild it") from exc
        if doc.get("format") != FORMAT_VERSION:
            raise BankError(
                NO_FEATURES, f"Prompt Bank at {path} has format {doc.get('format')!r}; rebuild it"
            )
        fields = {k: doc[k] for k in BankMeta.__dataclass_fields__ if k in doc}
        return cls(
            doc["prompts"],
            features,
            np.array(doc["labels"]),
            np.array(doc["medoids"]),
            BankMeta(**fields),
            path,
        )


# ------------------------------------------------------------------------------------- building
def _calibrate(
    model: Any, tokenizer: Any, prompts: Sequence[str], n_prompts: int = 16, n_samples: int = 16
) -> dict:
    """Measure seconds per scored (candidate × sample) row on synthetic samples of candidate text."""
    import torch

    from elastune_worker.bank.score import Scorer

    pool = list(prompts)[: max(2, n_prompts + n_samples)]
    recs = [
        {"input": pool[i % len(pool)][:40], "target": pool[(i + 1) % len(pool)][:24]}
        for i in range(n_samples)
    ]
    scorer = Scorer(model, tokenizer, recs, max_samples=n_samples)
    probe = (pool * 2)[:n_prompts]
    scorer.score(probe[:2])  # warm-up (allocator, kernels)
    t0 = time.perf_counter()
    scorer.score(probe)
    dt = time.perf_counter() - t0
    return {
        "seconds_per_row": dt / (len(probe) * scorer.n_samples),
        "rows": len(probe) * scorer.n_samples,
        "device": str(next(model.parameters()).device),
        "torch_threads": torch.get_num_threads(),
    }


def build_bank(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    candidates: Sequence[str] | None = None,
    k: int = DEFAULT_K,
    seed: int = 0,
    *,
    capacity: int = DEFAULT_CAPACITY,
    llm_key: str | None = None,
    extractor: FeatureExtractor | None = None,
    batch_size: int = 64,
    calibrate: bool = True,
    balanced: bool = True,
) -> PromptBank:
    """Extract features of ``candidates`` (the prompts the bank starts from) with the LLM in ``model_dir``,
    cluster them into ``k`` groups with FasterPAM, measure the per-row scoring cost, and save the bank
    to ``out_dir`` (default ``bank_dir(llm_key)``, the key defaulting to the resolved model path)."""
    t0 = time.perf_counter()
    prompts = list(dict.fromkeys(candidates or ()))
    key = llm_key or default_llm_key(model_dir)
    if not prompts:
        raise BankError(EMPTY_BANK, "no candidate prompts to build the bank from")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(prompts) > capacity:
        raise ValueError(f"{len(prompts)} candidates exceed the capacity {capacity}; raise capacity or trim")
    ex = extractor or FeatureExtractor.from_dir(model_dir, batch_size=batch_size)
    t_load = time.perf_counter()
    feats = ex(prompts)
    t_feat = time.perf_counter()
    labels, medoids, info = cluster(feats, k, seed, balanced)
    t_cluster = time.perf_counter()
    calib = _calibrate(ex.model, ex.tokenizer, prompts) if calibrate else {"seconds_per_row": 0.0}
    meta = BankMeta(
        llm=key,
        model_dir=str(Path(model_dir).resolve()),
        model_fingerprint=model_fingerprint(model_dir),
        feature_dim=int(feats.shape[1]),
        k=len(medoids),
        k_requested=k,
        balanced=balanced,
        capacity=capacity,
        seed=seed,
        seconds_per_row=float(calib["seconds_per_row"]),
        calibration=calib,
        build={
            "seconds": round(time.perf_counter() - t0, 3),
            "load_seconds": round(t_load - t0, 3),
            "feature_seconds": round(t_feat - t_load, 3),
            "cluster_seconds": round(t_cluster - t_feat, 3),
            "kmedoids": {"algorithm": "fasterpam", "distance": "cosine", **info},
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    bank = PromptBank(prompts, feats, labels, medoids, meta)
    bank._extractor = ex
    target = Path(out_dir) if out_dir is not None else bank_dir(key)
    bank.save(target)
    return bank


def load_bank(llm_key: str) -> PromptBank:
    """The bank of ``llm_key`` from the cache; BankError(NoFeatures) if it was never built."""
    return PromptBank.load(bank_dir(llm_key))


def ensure_bank(
    model_dir: str | Path,
    llm_key: str | None = None,
    *,
    k: int = DEFAULT_K,
    candidates: Sequence[str] | None = None,
    out_dir: str | Path | None = None,
) -> PromptBank:
    """The bank of this LLM, (re)built when missing or when the model changed under the same key.

    A new LLM needs its own features (§5.2 "re-extract the activation features of all gathered
    prompts"): on a rebuild for a changed model the old bank's prompts (inserted ones included) are
    re-featurised; a bank never built starts from ``candidates`` (EmptyBank without them).
    """
    key = llm_key or default_llm_key(model_dir)
    target = Path(out_dir) if out_dir is not None else bank_dir(key)
    old: PromptBank | None = None
    try:
        old = PromptBank.load(target)
    except BankError:
        old = None
    if old is not None and old.meta.model_fingerprint == model_fingerprint(model_dir):
        return old
    prompts = candidates if candidates is not None else (old.prompts if old is not None else None)
    capacity = old.capacity if old is not None else DEFAULT_CAPACITY
    return build_bank(model_dir, target, prompts, k, llm_key=key, capacity=capacity)
