"""Data-parallel PEFT prompt tuning with storage-channel gradient all-reduce (PromptTuner §5.1).

One ``Trainer`` per worker process (one pod = one GPU). Every step:

1. the GLOBAL batch is a pure function of (seed, step): epoch ``e`` visits the training records in the
   order of a permutation seeded by (seed, e), and step ``s`` takes positions ``[s·B, (s+1)·B)`` of that
   endless stream. No RNG state has to be saved or agreed on, a resumed or replacement worker finds its
   place from the step alone, and the job may even resume with a different number of workers;
2. worker ``w`` takes the contiguous shard ``np.array_split(batch, world)[w]`` and back-propagates
   ``loss_w = world/B · Σ_{i∈shard} l_i`` (``l_i`` = mean cross-entropy over the target tokens of sample
   ``i``), so the MEAN over workers of the gradients is the gradient of the mean per-sample loss over the
   whole global batch, exactly what one worker computing the full batch would get;
3. the trainable gradients (plus ``loss_w`` in one extra slot, which makes the all-reduced mean the
   global batch loss for free) are flattened into one float32 array, averaged with
   ``StorageAllReduce.allreduce_mean``, written back, and every worker takes the same optimizer step.
   The all-reduce hands every worker the same bytes, so the workers' parameters stay bit-identical.

Forward passes run with the model in eval mode (no dropout): nothing in a step depends on RNG, which is
what makes world=N equal world=1 and a resumed run equal an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, get_args

import numpy as np
import torch
import torch.nn.functional as F

from elastune_contract.vocabulary import Reason
from elastune_worker.fsutil import swap_into_place
from elastune_worker.hf_kv_cache import output_cache
from elastune_worker.tuning import metrics as M
from elastune_worker.tuning.data import Record

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from elastune_contract.api.tuningjob import TuningJobSpec

__all__ = [
    "DEFAULT_SEPARATOR",
    "MAX_ITERATIONS",
    "TARGET_REACHED",
    "CheckpointMismatch",
    "Encoded",
    "StepInfo",
    "Trainer",
    "TuningConfig",
    "TuningResult",
    "build_peft_model",
    "collate",
    "encode_record",
    "evaluate_artifact",
    "global_batch_indices",
    "greedy_generate",
    "init_text_ids",
    "latest_checkpoint",
    "load_artifact",
    "load_base_model",
    "logits_loss",
    "per_sample_loss",
    "pick_device",
    "training_rows",
]

log = logging.getLogger(__name__)

Method = Literal["promptTuning", "prefixTuning", "pTuning"]
Optimizer = Literal["adamw", "adam", "sgd"]

#: Termination reasons (CamelCase, ready for a status condition).
MAX_ITERATIONS: Final = Reason.MAX_ITERATIONS
TARGET_REACHED: Final = Reason.TARGET_REACHED

#: Input/target separator; equal to the tiny models' ``tiny.tasks.SEPARATOR`` so a model pretrained on
#: that corpus sees the layout it learned (`input → target`).
DEFAULT_SEPARATOR: Final = " →"

CHECKPOINT_FORMAT: Final = 1
ARTIFACT_FORMAT: Final = 1
_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")
_KEEP_CHECKPOINTS = 2  # the newest plus one fallback in case the newest is unreadable
IGNORE_INDEX: Final = -100


class AllReduce(Protocol):
    """What the trainer needs from ``comm.StorageAllReduce``."""

    def allreduce_mean(self, step: int, array: np.ndarray) -> np.ndarray: ...


class CheckpointMismatch(ValueError):
    """A checkpoint exists but was written by a run with other data or hyperparameters."""


class OutputNotOurs(ValueError):
    """The output location holds something no tuning run wrote (a user's directory or a file): a job
    replaces only an empty directory or an earlier artifact, never what it did not create."""


def check_output_location(out: Path) -> None:
    """OutputNotOurs unless ``out`` is absent, an empty directory or an artifact (metrics.json with our
    format). A ValueError, so the job fails with InvalidSpec and this message."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise OutputNotOurs(f"output {out} exists and is not a directory; refusing to replace it")
    if not any(out.iterdir()):
        return
    try:
        info = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict) or info.get("format") != ARTIFACT_FORMAT:
        raise OutputNotOurs(
            f"output {out} holds files that are not an artifact of a tuning run; refusing to replace "
            "them: name a new or empty directory"
        )


# ------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class TuningConfig:
    """Hyperparameters of one tuning run; identical on every worker of a job."""

    method: Method = "promptTuning"
    virtual_tokens: int = 20
    init_text: str | None = None
    """Initial prompt: TEXT init for promptTuning; for prefixTuning the prefix starts from the text's
    key/value activations (Li & Liang's real-word init); for pTuning the encoder's input table starts
    from the text's token embeddings."""
    learning_rate: float = 0.3
    optimizer: Optimizer = "adamw"
    batch_size: int = 8
    """GLOBAL batch size, split across workers."""
    max_iterations: int = 100
    target_metric: str | None = None
    target_value: float | None = None
    eval_every: int = 10
    """Steps between evaluations of the termination metric on the eval split."""
    checkpoint_every: int = 10
    """K: a replacement worker repeats at most K steps."""
    seed: int = 0
    max_length: int = 128
    """Tokens of input + target per sample (virtual tokens not included); longer inputs lose their head."""
    separator: str = DEFAULT_SEPARATOR
    max_new_tokens: int = 32
    """Generation budget for exactMatch/accuracy/bleu/rougeL."""
    eval_batch_size: int = 32
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in get_args(Method):
            raise ValueError(f"method must be one of {get_args(Method)}, got {self.method!r}")
        if self.optimizer not in get_args(Optimizer):
            raise ValueError(f"optimizer must be one of {get_args(Optimizer)}, got {self.optimizer!r}")
        for name in ("virtual_tokens", "batch_size", "max_iterations", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_length", "max_new_tokens", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        if (self.target_metric is None) != (self.target_value is None):
            raise ValueError("target_metric and target_value must be given together")
        if self.target_metric is not None and self.target_metric not in M.METRICS:
            raise ValueError(f"target_metric must be one of {M.METRICS}, got {self.target_metric!r}")

    @property
    def metric(self) -> str:
        """The metric reported as the job's current metric: the target's, else loss."""
        return self.target_metric or "loss"

    @classmethod
    def from_spec(cls, spec: TuningJobSpec, **overrides: Any) -> TuningConfig:
        """The config a TuningJob asks for; ``overrides`` set what the spec does not carry (eval_every,
        checkpoint_every, seed, max_length, ...)."""
        from elastune_contract.api import units  # decimals are strings in the spec (no floats in CRDs)

        hp = spec.hyperparameters
        target = spec.termination.target
        values: dict[str, Any] = {
            "method": spec.method,
            "virtual_tokens": hp.virtual_tokens,
            "init_text": spec.initial_prompt,
            "learning_rate": float(units.parse_decimal(hp.learning_rate)),
            "optimizer": hp.optimizer,
            "batch_size": hp.batch_size,
            "max_iterations": spec.termination.max_iterations,
            "target_metric": target.metric if target else None,
            "target_value": float(units.parse_decimal(target.value)) if target else None,
        }
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def training_fingerprint(self) -> dict[str, Any]:
        """Fields a checkpoint must agree on to be resumed (termination and cadence may change)."""
        keep = (
            "method", "virtual_tokens", "init_text", "learning_rate", "optimizer", "batch_size",
            "seed", "max_length", "separator", "weight_decay",
        )  # fmt: skip
        return {k: getattr(self, k) for k in keep}


@dataclass(frozen=True)
class StepInfo:
    """What ``progress_cb`` receives after every step."""

    step: int
    iterations: int
    loss: float
    seconds: float
    sync_seconds: float
    metric: str | None = None  # set on steps that ran an evaluation
    value: float | None = None


@dataclass
class TuningResult:
    iterations: int
    termination_reason: str
    metric: str
    value: float
    metrics: dict[str, float]
    """Final values on the eval split: always loss, plus the target metric when it is another one."""
    history: list[dict[str, Any]]
    """Per iteration: step, loss (global batch mean), seconds (compute), sync_seconds, run (0 for the
    first run, +1 per resume)."""
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: int | None = None
    """Iterations restored from a checkpoint at start, or None for a fresh run."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------- model setup
def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer of {model_dir} has no eos token; targets need one to stop")
    return tok


def _peft_config(model_dir: str | Path, cfg: TuningConfig) -> Any:
    from peft import (
        PrefixTuningConfig,
        PromptEncoderConfig,
        PromptTuningConfig,
        PromptTuningInit,
        TaskType,
    )

    if cfg.method == "promptTuning":
        if cfg.init_text:
            return PromptTuningConfig(
                task_type=TaskType.CAUSAL_LM,
                num_virtual_tokens=cfg.virtual_tokens,
                prompt_tuning_init=PromptTuningInit.TEXT,
                prompt_tuning_init_text=cfg.init_text,
                tokenizer_name_or_path=str(model_dir),
                tokenizer_kwargs={"local_files_only": True},
            )
        return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=cfg.virtual_tokens)
    if cfg.method == "prefixTuning":
        return PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=cfg.virtual_tokens)
    return PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=cfg.virtual_tokens)


def init_text_ids(tok: PreTrainedTokenizerBase, text: str, n: int) -> list[int]:
    """The text's token ids repeated or cut to ``n`` (what PEFT's TEXT init does)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("init_text encodes to no tokens")
    return (ids * math.ceil(n / len(ids)))[:n]


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56 Cache objects
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer][0], cache[layer][1]  # legacy tuple of tuples


@torch.no_grad()
def _apply_text_init(model: PeftModel, tok: PreTrainedTokenizerBase, cfg: TuningConfig) -> None:
    """init_text for the methods PEFT cannot TEXT-initialise."""
    assert cfg.init_text
    ids = torch.tensor([init_text_ids(tok, cfg.init_text, cfg.virtual_tokens)])
    encoder = model.prompt_encoder["default"]
    base = model.get_base_model()
    if cfg.method == "pTuning":
        encoder.embedding.weight.copy_(base.get_input_embeddings()(ids)[0])
        return
    # prefixTuning: the prefix a text would leave in the KV cache. Laid out as PEFT's get_prompt reads
    # it back: view(nv, layers*2, heads, head_dim) with index layer*2 + (0 key | 1 value).
    cache = output_cache(base(input_ids=ids, use_cache=True))
    pcfg = model.peft_config["default"]
    per_layer = []
    for layer in range(pcfg.num_layers):
        k, v = _layer_kv(cache, layer)  # (1, heads, nv, head_dim)
        per_layer.append(torch.stack([k[0], v[0]]).permute(2, 0, 1, 3))  # (nv, 2, heads, head_dim)
    weight = torch.stack(per_layer, dim=1).reshape(cfg.virtual_tokens, -1)
    encoder.embedding.weight.copy_(weight)


def build_peft_model(
    model_dir: str | Path,
    cfg: TuningConfig,
    device: torch.device | str | None = None,
    base_model: Any | None = None,
) -> PeftModel:
    """The base model with the method's trainable virtual tokens, frozen base, in eval mode.

    Initialisation is seeded by ``cfg.seed`` (without disturbing the caller's RNG) and done on the CPU
    before moving to ``device``, so every worker of a job starts from the same parameters (a base with
    random weights is made on ``device`` directly, from its config's seed: ``load_base_model``).
    ``base_model``: the already loaded base of a warm worker, reused instead of reading the weights
    again. Prompt-learning methods only wrap it (no layer is injected or modified), so one base serves
    job after job; pass it on the CPU or on ``device``.
    """
    from peft import get_peft_model

    device = torch.device(device) if device is not None else pick_device()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        base = base_model if base_model is not None else load_base_model(model_dir, device)
        model = get_peft_model(base, _peft_config(model_dir, cfg))
        if cfg.init_text and cfg.method != "promptTuning":
            _apply_text_init(model, _load_tokenizer(model_dir), cfg)
    model.to(device)
    model.eval()  # no dropout: steps must not depend on RNG (equivalence across world sizes, resume)
    return model


def load_base_model(model_dir: str | Path, device: torch.device | str | None = None) -> Any:
    """The base model of ``model_dir`` (transformers' AutoModelForCausalLM): its weights read on the
    CPU (``build_peft_model`` moves it), or, for a config.json that asks for random weights
    (modeling/random_init.py: benchmarks at a real size, e.g. Llama-3-8B), made on
    ``device`` from the config alone without reading a file, in the config's dtype on CUDA (bf16 for
    the 8B shape: 15 GiB, never a float32 copy) and in float32 on the CPU. Load it once and pass it as
    ``base_model`` to every Trainer of the same model (one copy of the weights for job after job)."""
    from transformers import AutoModelForCausalLM

    from elastune_worker.modeling.random_init import hf_random_model, read_random_config

    random_cfg = read_random_config(Path(model_dir))
    if random_cfg is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    device = torch.device(device) if device is not None else pick_device()
    dtype = torch.float32
    if device.type == "cuda":
        named = random_cfg.get("torch_dtype") or random_cfg.get("dtype") or "bfloat16"
        dtype = getattr(torch, str(named))
    return hf_random_model(random_cfg, device, dtype)


# -------------------------------------------------------------------------------- data and batches
@functools.lru_cache(maxsize=8)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def global_batch_indices(n_train: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Training-record indices of the global batch of ``step``: positions ``[step·B, (step+1)·B)`` of
    the concatenation of per-epoch permutations seeded by (seed, epoch)."""
    if n_train < 1:
        raise ValueError("no training records")
    out: list[np.ndarray] = []
    pos, need = step * batch_size, batch_size
    while need:
        epoch, offset = divmod(pos, n_train)
        take = min(need, n_train - offset)
        out.append(_epoch_permutation(n_train, seed, epoch)[offset : offset + take])
        pos, need = pos + take, need - take
    return np.concatenate(out)


@dataclass(frozen=True)
class Encoded:
    source: list[int]
    target: list[int]  # ends with eos


def encode_record(tok: PreTrainedTokenizerBase, rec: Record, cfg: TuningConfig) -> Encoded:
    source = tok(rec["input"] + cfg.separator, add_special_tokens=False)["input_ids"]
    target = tok(" " + rec["target"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    target = target[: max(1, cfg.max_length - 1)]
    source = source[-(cfg.max_length - len(target)) :]  # keep the tail: the separator must stay
    return Encoded(source, target)


def _pad_id(tok: PreTrainedTokenizerBase) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def collate(
    rows: Sequence[tuple[list[int], list[int]]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) from (tokens, labels) rows."""
    width = max(len(t) for t, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (tokens, labs) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = 1
        labels[i, : len(labs)] = torch.tensor(labs)
    return ids.to(device), mask.to(device), labels.to(device)


def training_rows(encoded: Sequence[Encoded]) -> list[tuple[list[int], list[int]]]:
    return [(e.source + e.target, [IGNORE_INDEX] * len(e.source) + e.target) for e in encoded]


def per_sample_loss(
    model: PeftModel, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy over each sample's target tokens, shape (batch,)."""
    return logits_loss(model(input_ids=ids, attention_mask=mask).logits, labels)


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``per_sample_loss`` from the logits: mean cross-entropy over each sample's target tokens."""
    # promptTuning/pTuning prepend virtual positions to the logits; prefixTuning does not.
    logits = logits[:, -labels.shape[1] :, :]
    shift_logits, shift_labels = logits[:, :-1, :].float(), labels[:, 1:]
    ce = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(shift_labels.shape)
    counts = (shift_labels != IGNORE_INDEX).sum(dim=1)
    return ce.sum(dim=1) / counts


# ------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def _eval_loss(
    model: PeftModel, encoded: Sequence[Encoded], pad_id: int, batch_size: int, device: torch.device
) -> float:
    total = 0.0
    for start in range(0, len(encoded), batch_size):
        rows = training_rows(encoded[start : start + batch_size])
        total += float(per_sample_loss(model, *collate(rows, pad_id, device)).double().sum())
    return total / len(encoded)


@torch.no_grad()
def greedy_generate(
    model: PeftModel, tok: PreTrainedTokenizerBase, inputs: Sequence[str], cfg: TuningConfig
) -> list[str]:
    """Greedy continuations of ``input + separator`` until eos or ``max_new_tokens``.

    A plain loop of full forward passes with right padding (no KV cache): it goes through the same
    forward as training for all three methods, and the virtual tokens and positions of a sample do not
    depend on what else is in the batch (left padding would shift them).
    """
    device = next(model.parameters()).device
    pad_id, eos = _pad_id(tok), tok.eos_token_id
    budget = cfg.max_length
    outputs: list[str] = []
    for start in range(0, len(inputs), cfg.eval_batch_size):
        chunk = inputs[start : start + cfg.eval_batch_size]
        keep = max(1, budget - cfg.max_new_tokens)
        prompts = [tok(x + cfg.separator, add_special_tokens=False)["input_ids"][-keep:] for x in chunk]
        new: list[list[int]] = [[] for _ in chunk]
        done = [False] * len(chunk)
        for _ in range(cfg.max_new_tokens):
            active = [i for i in range(len(chunk)) if not done[i]]
            if not active:
                break
            rows = [(prompts[i] + new[i], []) for i in active]
            ids, mask, _ = collate(rows, pad_id, device)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -ids.shape[1] :, :]
            last = mask.sum(dim=1) - 1
            nxt = logits[torch.arange(len(active), device=device), last].argmax(dim=-1).tolist()
            for i, token in zip(active, nxt, strict=True):
                if token == eos:
                    done[i] = True
                else:
                    new[i].append(token)
                    done[i] = len(prompts[i]) + len(new[i]) >= budget
        outputs += [tok.decode(t, skip_special_tokens=True).strip() for t in new]
    return outputs


def _evaluate(
    model: PeftModel,
    tok: PreTrainedTokenizerBase,
    records: Sequence[Record],
    metric: str,
    cfg: TuningConfig,
    encoded: Sequence[Encoded] | None = None,
) -> float:
    if not records:
        raise ValueError("no evaluation records")
    if metric == "loss":
        device = next(model.parameters()).device
        encoded = encoded if encoded is not None else [encode_record(tok, r, cfg) for r in records]
        return _eval_loss(model, encoded, _pad_id(tok), cfg.eval_batch_size, device)
    predictions = greedy_generate(model, tok, [r["input"] for r in records], cfg)
    return M.corpus_score(metric, predictions, [r["target"] for r in records])


def _records_digest(records: Sequence[Record]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps([r["input"], r["target"]], ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- trainer
def latest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint file (temp files of interrupted writes are never matched)."""
    d = Path(checkpoint_dir)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _CKPT_RE.match(p.name))
    return found[-1] if found else None


class Trainer:
    """Tunes the virtual tokens of ``model_dir`` on ``records_train``; one instance per worker.

    ``allreduce`` (a ``comm.StorageAllReduce`` of this worker) is required when ``world > 1``. With a
    ``checkpoint_dir``, the run resumes from its newest checkpoint and worker 0 writes one every
    ``checkpoint_every`` steps and at the end (the directory is meant to be shared, e.g. a PVC; all
    workers read it, one writes it). Recovery from a lost worker: every worker builds a new Trainer (it
    resumes from the newest checkpoint) with a ``StorageAllReduce`` under a NEW job key, since keys of
    the failed attempt's steps cannot be told apart from the retry's. The world size may change on
    resume: the global batches depend on (seed, step) only.

    Every worker evaluates the whole eval split (identical parameters and inputs give identical values),
    so all of them take the same termination decision without another collective.
    """

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TuningConfig,
        records_train: Sequence[Record],
        records_eval: Sequence[Record],
        worker: int = 0,
        world: int = 1,
        allreduce: AllReduce | None = None,
        checkpoint_dir: str | Path | None = None,
        device: torch.device | str | None = None,
        write_checkpoints: bool | None = None,
        base_model: Any | None = None,
    ) -> None:
        if world < 1 or not 0 <= worker < world:
            raise ValueError(f"need 0 <= worker < world, got worker={worker} world={world}")
        if world > 1 and allreduce is None:
            raise ValueError(f"world={world} needs an allreduce to average gradients")
        if not records_train:
            raise ValueError("no training records")
        if cfg.target_metric is not None and not records_eval:
            raise ValueError(f"target {cfg.target_metric} needs evaluation records")
        self.model_dir = Path(model_dir)
        self.cfg = cfg
        self.worker, self.world = worker, world
        self.allreduce = allreduce
        self.records_train = list(records_train)
        self.records_eval = list(records_eval)
        self.device = torch.device(device) if device is not None else pick_device()
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.write_checkpoints = (worker == 0) if write_checkpoints is None else write_checkpoints

        self.tokenizer = _load_tokenizer(self.model_dir)
        self.model = build_peft_model(self.model_dir, cfg, self.device, base_model=base_model)
        self._check_context_fits()
        self._pad_id = _pad_id(self.tokenizer)
        self._train_enc = [encode_record(self.tokenizer, r, cfg) for r in self.records_train]
        self._eval_enc = [encode_record(self.tokenizer, r, cfg) for r in self.records_eval]
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = self._make_optimizer()

        self.iterations = 0
        self.history: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        self.run_index = 0
        self.resumed_from: int | None = None
        self.result: TuningResult | None = None
        if self.checkpoint_dir is not None:
            self._resume()

    # -- setup
    def _check_context_fits(self) -> None:
        limit = getattr(self.model.get_base_model().config, "n_positions", None) or getattr(
            self.model.get_base_model().config, "max_position_embeddings", None
        )
        need = self.cfg.max_length + self.cfg.virtual_tokens
        if limit is not None and need > limit:
            raise ValueError(
                f"max_length ({self.cfg.max_length}) + virtual_tokens ({self.cfg.virtual_tokens}) = {need} "
                f"exceeds the model's context of {limit} positions"
            )

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for _, p in self.params]
        lr, wd = self.cfg.learning_rate, self.cfg.weight_decay
        if self.cfg.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
        if self.cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=wd)
        return torch.optim.SGD(params, lr=lr, weight_decay=wd)

    @property
    def n_trainable(self) -> int:
        return sum(p.numel() for _, p in self.params)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Copies of the trainable parameters by name (CPU)."""
        return {n: p.detach().cpu().clone() for n, p in self.params}

    # -- evaluation
    def evaluate(self, metric: str | None = None) -> float:
        """``metric`` (default: the config's) on the eval split with the current parameters."""
        metric = metric or self.cfg.metric
        enc = self._eval_enc if metric == "loss" else None
        return _evaluate(self.model, self.tokenizer, self.records_eval, metric, self.cfg, enc)

    # -- one step
    def _flat_grads(self, extra: float) -> np.ndarray:
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
            for _, p in self.params
        ]
        parts.append(torch.tensor([extra], dtype=torch.float32))
        return torch.cat(parts).numpy()

    def _write_grads(self, flat: np.ndarray) -> None:
        offset = 0
        for _, p in self.params:
            n = p.numel()
            grad = torch.from_numpy(flat[offset : offset + n].copy()).view_as(p).to(p.device, p.dtype)
            p.grad = grad
            offset += n

    def step(self, step: int) -> dict[str, Any]:
        """Run optimizer step ``step`` (0-based) on this worker's shard; returns its history entry."""
        t0 = time.perf_counter()
        batch = global_batch_indices(len(self._train_enc), self.cfg.batch_size, self.cfg.seed, step)
        shard = np.array_split(batch, self.world)[self.worker]
        self.optimizer.zero_grad(set_to_none=True)
        local = 0.0
        if len(shard):  # a batch smaller than the world leaves some shards empty: they send zeros
            rows = training_rows([self._train_enc[i] for i in shard])
            losses = per_sample_loss(self.model, *collate(rows, self._pad_id, self.device))
            loss_w = losses.sum() * (self.world / self.cfg.batch_size)
            loss_w.backward()
            local = float(loss_w.detach())
        flat = self._flat_grads(local)
        t1 = time.perf_counter()
        if self.allreduce is not None:
            flat = self.allreduce.allreduce_mean(step, flat)
        t2 = time.perf_counter()
        self._write_grads(flat[:-1])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        entry = {
            "step": step,
            "loss": float(flat[-1]),  # mean of loss_w over workers = mean per-sample loss of the batch
            "seconds": (t1 - t0) + (t3 - t2),
            "sync_seconds": t2 - t1,
            "run": self.run_index,
        }
        self.history.append(entry)
        self.iterations = step + 1
        return entry

    # -- the loop
    def run(self, progress_cb: Callable[[StepInfo], None] | None = None) -> TuningResult:
        """Train until max_iterations or the target is reached; resumes where a checkpoint left off."""
        cfg = self.cfg
        reason = MAX_ITERATIONS
        first = self.iterations
        last = self.evaluations[-1] if self.evaluations else None
        if last is not None and last["iterations"] == first and self._target_reached(last["value"]):
            # restored from the final checkpoint of a run that had reached its target: do not train on
            reason, first = TARGET_REACHED, cfg.max_iterations
        for step in range(first, cfg.max_iterations):
            entry = self.step(step)
            value = None
            if self.iterations % cfg.eval_every == 0 and self.records_eval:
                value = self.evaluate(cfg.metric)
                self.evaluations.append({"step": step, "iterations": self.iterations, "value": value})
            done = value is not None and self._target_reached(value)
            if done or self.iterations % cfg.checkpoint_every == 0 or self.iterations == cfg.max_iterations:
                self._save_checkpoint()  # the final state must survive for the artifact
            if progress_cb is not None:
                progress_cb(
                    StepInfo(
                        step=step,
                        iterations=self.iterations,
                        loss=entry["loss"],
                        seconds=entry["seconds"],
                        sync_seconds=entry["sync_seconds"],
                        metric=cfg.metric if value is not None else None,
                        value=value,
                    )
                )
            if done:
                reason = TARGET_REACHED
                break
        return self.finish(reason)

    def finish(self, reason: str) -> TuningResult:
        """The result after the last step (final evaluation on the eval split); ``save_artifact`` needs it.
        Also the end of a co-served run, whose steps ran inside engine iterations."""
        cfg = self.cfg
        final: dict[str, float] = {}
        if self.records_eval:
            # Reuse an evaluation of exactly these parameters (same code, same inputs: same value).
            fresh = bool(self.evaluations) and self.evaluations[-1]["iterations"] == self.iterations
            final[cfg.metric] = self.evaluations[-1]["value"] if fresh else self.evaluate(cfg.metric)
            if "loss" not in final:
                final["loss"] = self.evaluate("loss")
        self.result = TuningResult(
            iterations=self.iterations,
            termination_reason=reason,
            metric=cfg.metric,
            value=final.get(cfg.metric, float("nan")),
            metrics=final,
            history=list(self.history),
            evaluations=list(self.evaluations),
            resumed_from=self.resumed_from,
        )
        return self.result

    def _target_reached(self, value: float) -> bool:
        cfg = self.cfg
        if cfg.target_metric is None or cfg.target_value is None:
            return False
        return M.reached(cfg.target_metric, value, cfg.target_value)

    # -- checkpoints
    def _fingerprint(self) -> dict[str, Any]:
        return {
            "config": self.cfg.training_fingerprint(),
            "train_sha256": _records_digest(self.records_train),
            "trainable": {n: list(p.shape) for n, p in self.params},
        }

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the current state now (co-served runs checkpoint between steps)."""
        self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        if self.checkpoint_dir is None or not self.write_checkpoints:
            return
        d = self.checkpoint_dir
        d.mkdir(parents=True, exist_ok=True)
        epoch, offset = divmod(self.iterations * self.cfg.batch_size, len(self._train_enc))
        state = {
            "format": CHECKPOINT_FORMAT,
            "iterations": self.iterations,
            # Informational: the data position is a function of the step (global_batch_indices).
            "data_position": {"epoch": epoch, "offset": offset},
            "trainable": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
            "evaluations": self.evaluations,
            "run_index": self.run_index,
            "fingerprint": json.dumps(self._fingerprint(), sort_keys=True),
        }
        final = d / f"ckpt-{self.iterations:08d}.pt"
        # Write-then-rename in the same directory: a reader sees the old file or the whole new one.
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=d)
        try:
            with os.fdopen(fd, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(d)
        for old in sorted(p for p in d.iterdir() if _CKPT_RE.match(p.name))[:-_KEEP_CHECKPOINTS]:
            old.unlink(missing_ok=True)

    def _resume(self) -> None:
        assert self.checkpoint_dir is not None
        d = self.checkpoint_dir
        names = sorted(p for p in d.iterdir() if _CKPT_RE.match(p.name)) if d.is_dir() else []
        candidates = names[::-1]  # newest first
        for path in candidates:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torn or foreign file: fall back to the previous checkpoint
                log.warning("skipping unreadable checkpoint %s: %s", path, exc)
                continue
            if state.get("format") != CHECKPOINT_FORMAT:
                log.warning("skipping checkpoint %s of format %r", path, state.get("format"))
                continue
            mine = json.dumps(self._fingerprint(), sort_keys=True)
            if state["fingerprint"] != mine:
                raise CheckpointMismatch(
                    f"checkpoint {path} was written by a run with other data or hyperparameters: "
                    f"{state['fingerprint']} != {mine}; use a fresh checkpoint directory"
                )
            with torch.no_grad():
                for name, p in self.params:
                    p.copy_(state["trainable"][name].to(p.device, p.dtype))
            self.optimizer.load_state_dict(state["optimizer"])
            self.iterations = int(state["iterations"])
            self.history = list(state["history"])
            self.evaluations = list(state["evaluations"])
            self.run_index = int(state["run_index"]) + 1
            self.resumed_from = self.iterations
            log.info("resumed from %s at iteration %d", path, self.iterations)
            return

    # -- output
    def prompt_projection(self) -> tuple[str, list[int]] | None:
        """Nearest vocabulary token (cosine, input embeddings) per virtual token; None for prefixTuning,
        whose virtual tokens live in key/value space, not in the input embedding space."""
        if self.cfg.method == "prefixTuning":
            return None
        prompt = self.model.get_prompt_embedding_to_save("default").float()
        return _project(self.model, self.tokenizer, prompt)

    def save_artifact(self, out_dir: str | Path) -> Path:
        """PEFT adapter (save_pretrained) + prompt.txt + metrics.json, swapped into ``out_dir`` whole."""
        if self.result is None:
            raise RuntimeError("run() first: the artifact records the final metrics")
        out = Path(out_dir).absolute()
        check_output_location(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            self.model.save_pretrained(str(tmp))
            _portable_adapter_config(tmp / "adapter_config.json")
            projection = self.prompt_projection()
            (tmp / "prompt.txt").write_text(projection[0] if projection else "", encoding="utf-8")
            info = {
                "format": ARTIFACT_FORMAT,
                "metric": self.result.metric,
                "value": self.result.value,
                "metrics": self.result.metrics,
                "iterations": self.result.iterations,
                "termination_reason": self.result.termination_reason,
                "config": self.cfg.to_dict(),
                "base_model": str(self.model_dir),
                "eval_records": len(self.records_eval),
                "eval_sha256": _records_digest(self.records_eval),
                "prompt_token_ids": projection[1] if projection else None,
                "prompt_projection": "nearest-input-embedding-cosine" if projection else None,
            }
            (tmp / "metrics.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            swap_into_place(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out


def _portable_adapter_config(path: Path) -> None:
    """Drop TEXT init from the saved adapter config: PeftModel.from_pretrained would otherwise load the
    tokenizer from the tuning pod's model path just to compute an init the saved weights overwrite."""
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("prompt_tuning_init") == "TEXT":
        config["prompt_tuning_init"] = "RANDOM"
        config["tokenizer_name_or_path"] = None
        config["tokenizer_kwargs"] = None  # PEFT accepts these only with TEXT init
        path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@torch.no_grad()
def _project(model: PeftModel, tok: PreTrainedTokenizerBase, prompt: torch.Tensor) -> tuple[str, list[int]]:
    table = model.get_base_model().get_input_embeddings().weight.float()
    sims = F.normalize(prompt.to(table.device), dim=-1) @ F.normalize(table, dim=-1).T
    special = [i for i in tok.all_special_ids if i < sims.shape[1]]
    sims[:, special] = -2.0  # cosine >= -1: special tokens are never chosen
    ids = sims.argmax(dim=-1).tolist()
    return tok.decode(ids), ids


# ----------------------------------------------------------------------------------------- artifact
def load_artifact(
    model_dir: str | Path, artifact_dir: str | Path, device: torch.device | str | None = None
) -> PeftModel:
    """The base model with the tuned virtual tokens of ``artifact_dir``, in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    device = torch.device(device) if device is not None else pick_device()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    model = PeftModel.from_pretrained(base, str(artifact_dir))
    model.to(device)
    model.eval()
    return model


def evaluate_artifact(
    model_dir: str | Path,
    artifact_dir: str | Path,
    records: Sequence[Record],
    metric: str | None = None,
) -> float:
    """Re-evaluate a saved artifact with the settings it was tuned with (separator, lengths, batch
    size); ``metric`` defaults to the one in its metrics.json."""
    info = json.loads((Path(artifact_dir) / "metrics.json").read_text(encoding="utf-8"))
    cfg = TuningConfig(**info["config"])
    model = load_artifact(model_dir, artifact_dir)
    return _evaluate(model, _load_tokenizer(model_dir), records, metric or info["metric"], cfg)
