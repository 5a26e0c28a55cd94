"""score(p) of PromptTuner Eqn. 1: mean loss of the target given concat(p, input), batched.

The layout is the tuning loop's, token for token, so a score means what tuning will see:

* each record is encoded by ``tuning.trainer.encode_record`` (``input + " →"`` as source, ``" " + target +
  eos`` as target, same truncation), and the loss is the mean cross-entropy over the target tokens of a
  sample (``trainer.per_sample_loss``), averaged over samples;
* ``layout="soft"`` (default) puts in front exactly what promptTuning with ``init_text=p`` starts from:
  p's token ids repeated and cut to ``virtual_tokens`` (PEFT's TEXT init, ``trainer.init_text_ids``).
  A virtual token initialised from a word embedding *is* that word at that position, so score(p) equals
  the tuning run's loss before its first step;
* ``layout="text"`` puts ``p + "\\n"`` in front, the tiny corpus' ``format_example(input, target, p)``
  layout (for methods other than promptTuning, or a discrete prompt used without tuning).

Batching: rows of many (candidate, sample) pairs go through one forward pass. Right padding with an
attention mask leaves every real token's logits unchanged, so batched and one-by-one scores agree to
float rounding (tested).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from elastune_worker.bank.errors import NO_TARGETS, BankError
from elastune_worker.hf_kv_cache import cache_kwargs, output_cache

__all__ = ["DEFAULT_VIRTUAL_TOKENS", "Layout", "Scorer", "check_records"]

Layout = Literal["soft", "text"]
DEFAULT_VIRTUAL_TOKENS = 20  # TuningConfig's default


def check_records(records: Sequence[Mapping[str, Any]] | None, max_samples: int) -> list[dict[str, str]]:
    """The first ``max_samples`` records that carry a non-empty target; NoTargets if there are none.

    Records without a target are dropped rather than fatal when others have one: the score is still
    Eqn. 1 over the labelled samples. A sample without an input is fine (empty input).
    """
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    if not records:
        raise BankError(NO_TARGETS, "no evaluation samples: score(p) needs a few {input, target} pairs")
    kept: list[dict[str, str]] = []
    for rec in records:
        target = rec.get("target") if isinstance(rec, Mapping) else None
        if isinstance(target, str) and target.strip():
            kept.append({"input": str(rec.get("input") or ""), "target": target})
    if not kept:
        raise BankError(
            NO_TARGETS,
            f"none of the {len(records)} evaluation samples has a target; label a few (≤ 16) to use the bank",
        )
    return kept[:max_samples]


class Scorer:
    """Scores prompts on a fixed set of evaluation samples with one model."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        records: Sequence[Mapping[str, Any]],
        *,
        max_samples: int = 16,
        layout: Layout = "soft",
        virtual_tokens: int = DEFAULT_VIRTUAL_TOKENS,
        separator: str | None = None,
        max_length: int = 128,
        batch_rows: int = 256,
        fast: bool = True,
    ) -> None:
        import torch  # noqa: F401  (fail early, before any work, if torch is missing)

        from elastune_worker.tuning.trainer import DEFAULT_SEPARATOR, TuningConfig, encode_record

        if layout not in ("soft", "text"):
            raise ValueError(f"layout must be 'soft' or 'text', got {layout!r}")
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        self.records = check_records(records, max_samples)
        self.model = model
        self.tokenizer = tokenizer
        self.layout: Layout = layout
        self.virtual_tokens = virtual_tokens
        self.batch_rows = batch_rows
        sep = DEFAULT_SEPARATOR if separator is None else separator
        # The trainer's own encoder and settings: the same tokens as the tuning loop.
        self._cfg = TuningConfig(separator=sep, max_length=max_length, virtual_tokens=virtual_tokens)
        self._encoded = [encode_record(tokenizer, r, self._cfg) for r in self.records]
        pad = tokenizer.pad_token_id
        self._pad = pad if pad is not None else tokenizer.eos_token_id
        limit = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", 0
        )
        longest = max(len(e.source) + len(e.target) for e in self._encoded)
        self._prompt_budget = max(1, limit - longest) if limit else None
        self.evaluations = 0  # prompts scored so far (a prompt = one evaluation over all samples)
        self.fast = fast
        self._samples: tuple[Any, ...] | None = None

    @property
    def n_samples(self) -> int:
        return len(self.records)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The tokens placed before every sample for ``prompt``."""
        from elastune_worker.tuning.trainer import init_text_ids

        if self.layout == "soft":
            try:
                ids = init_text_ids(self.tokenizer, prompt, self.virtual_tokens)
            except ValueError:  # a prompt of no tokens: PEFT would refuse it; score it as empty
                ids = []
        else:
            ids = self.tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"]
        if self._prompt_budget is not None and len(ids) > self._prompt_budget:
            ids = ids[: self._prompt_budget]  # keep the head: truncation only for absurdly long prompts
        return ids

    def score(self, prompts: Sequence[str]) -> np.ndarray:
        """score(p) for each prompt, float64, lower is better; counts ``len(prompts)`` evaluations."""
        import torch

        n_s = len(self._encoded)
        out = np.empty(len(prompts), dtype=np.float64)
        per_batch = max(1, self.batch_rows // n_s)  # whole candidates per forward pass
        with torch.inference_mode():
            for start in range(0, len(prompts), per_batch):
                heads = [self.prompt_ids(p) for p in prompts[start : start + per_batch]]
                same = len({len(h) for h in heads}) == 1 and len(heads[0]) > 0
                losses = self._losses_cached(heads) if (self.fast and same) else self._losses_plain(heads)
                losses = np.where(np.isfinite(losses), losses, math.inf)
                out[start : start + len(heads)] = losses.reshape(len(heads), n_s).mean(axis=1)
        self.evaluations += len(prompts)
        return out

    def _losses_plain(self, heads: list[list[int]]) -> np.ndarray:
        """Per (prompt, sample) losses with the trainer's own collate and loss (the reference path)."""
        from elastune_worker.tuning.trainer import Encoded, collate, per_sample_loss, training_rows

        device = next(self.model.parameters()).device
        # The prompt joins the source side: masked out of the loss like the input.
        encoded = [Encoded(h + e.source, e.target) for h in heads for e in self._encoded]
        rows = collate(training_rows(encoded), self._pad, device)
        return per_sample_loss(self.model, *rows).double().cpu().numpy()

    def _losses_cached(self, heads: list[list[int]]) -> np.ndarray:
        """Same losses, computed faster: each prompt runs once and its key/value cache is shared by all
        samples (the prompt is ~40 % of a row, scored 16 times otherwise), and the LM head runs only
        where a target token is predicted. Needs prompts of equal length (always so in the soft layout),
        so positions continue from one offset; samples are right-padded after the prompt.
        """
        import torch
        import torch.nn.functional as F

        model, device = self.model, next(self.model.parameters()).device
        n_p, n_s, lp = len(heads), len(self._encoded), len(heads[0])
        prompt = torch.tensor(heads, dtype=torch.long, device=device)
        cache = output_cache(model(input_ids=prompt, use_cache=True))
        cache.batch_repeat_interleave(n_s)  # row p*S + s continues prompt p
        ids, mask, rows_t, pos_t, labels, seg = self._sample_tensors(device)
        ids, mask = ids.repeat(n_p, 1), mask.repeat(n_p, 1)
        full_mask = torch.cat([torch.ones((n_p * n_s, lp), dtype=torch.long, device=device), mask], dim=1)
        positions = (torch.arange(ids.shape[1], device=device) + lp).expand(n_p * n_s, -1)
        hidden = model.base_model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=positions,
            **cache_kwargs(model.base_model, cache),
        ).last_hidden_state
        offsets = (torch.arange(n_p, device=device) * n_s).repeat_interleave(len(rows_t))
        picked = hidden[rows_t.repeat(n_p) + offsets, pos_t.repeat(n_p)]
        logits = model.get_output_embeddings()(picked).float()
        ce = F.cross_entropy(logits, labels.repeat(n_p), reduction="none").double()
        segs = seg.repeat(n_p) + torch.arange(n_p, device=device).repeat_interleave(len(seg)) * n_s
        sums = torch.zeros(n_p * n_s, dtype=torch.float64, device=device).index_add_(0, segs, ce)
        counts = torch.bincount(segs, minlength=n_p * n_s).clamp(min=1)
        return (sums / counts).cpu().numpy()

    def _sample_tensors(self, device: Any) -> tuple[Any, ...]:
        """Padded samples and, per target token, (row, position whose logits predict it, label, row)."""
        import torch

        if self._samples is None:
            seqs = [e.source + e.target for e in self._encoded]
            width = max(len(x) for x in seqs)
            ids = torch.full((len(seqs), width), self._pad, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            rows, pos, labels = [], [], []
            for i, (x, e) in enumerate(zip(seqs, self._encoded, strict=True)):
                ids[i, : len(x)] = torch.tensor(x)
                mask[i, : len(x)] = 1
                for t in range(len(e.source), len(x)):  # token t is predicted at position t - 1
                    rows.append(i)
                    pos.append(t - 1)
                    labels.append(x[t])
            r = torch.tensor(rows, dtype=torch.long)
            self._samples = (ids, mask, r, torch.tensor(pos), torch.tensor(labels), r)
        return tuple(t.to(device) for t in self._samples)
