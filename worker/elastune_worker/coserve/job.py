"""FlexLLM's token-level finetuning (§6.1), the torch half: a prompt-learning TuningJob co-served beside
the engine's inference, run in the pieces the planner (planner.py) hands each iteration.

One optimizer step of the job is the dedicated trainer's step (same global batch of (seed, step), same
loss scaling, same optimizer): its global batch, right-padded as the trainer pads it, is finetuned as
one sequence of rows x positions (batched like the trainer; a window is whole positions of every row):

* forward windows: consecutive token windows through the frozen base with a KV cache of the virtual
  tokens (or the prefix) and the earlier windows, keeping the autograd graph; each decoder layer's output
  is cut from the next layer by a leaf tensor (a forward hook), so the graph is one segment per layer;
* backward layer by layer, last first: the loss is back-propagated into the last layer's output leaves,
  then each layer's segment (all windows at once, so the gradients that later windows send to earlier
  tokens' keys and values are included: FlexLLM's KV-gradient accumulation) into the layer below, and the
  prompt segment (virtual-token embeddings, p-tuning's encoder, or the prefix) last. The gradient equals
  the ordinary full backward.

When a step's last sample finishes its backward, the optimizer steps as in ``Trainer.step``. The job uses
the trainer's own PEFT model (its own copy of the base weights: sharing the engine's weights is not done,
the engine runs its own model implementation).

Data parallel (world > 1): each worker co-serves its shard of the global batch, exactly the trainer's
shard and loss scale, and the gradients are averaged through the trainer's storage-channel all-reduce
(PromptTuner §5.1) before the optimizer step. The all-reduce waits for the slowest peer, so it runs on a
background thread: the engine keeps serving inference meanwhile and the job takes no finetuning budget
(``state()`` is None) until the mean gradient is back; the step is then applied between engine steps.
A failed all-reduce (a peer lost, the timeout) drops the job with the reason — its attempt then fails
and resumes from the last checkpoint like a dedicated one.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elastune_worker.coserve.planner import FinetuneState, IterationPlan
from elastune_worker.hf_kv_cache import cache_kwargs, output_cache
from elastune_worker.tuning.trainer import (
    Trainer,
    collate,
    global_batch_indices,
    logits_loss,
    training_rows,
)


def decoder_layers(base: Any) -> torch.nn.ModuleList:
    """The decoder blocks of a Llama-family (``model.layers``) or GPT-2 (``transformer.h``) model."""
    inner = getattr(base, base.base_model_prefix)
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(base).__name__}: no decoder layer list found")
    return layers


@dataclass
class _Sequence:
    """One sample in flight: its forward windows' graph segments, then their gradients."""

    tokens: int
    """Sample tokens of the batch (pads and virtual tokens not counted)."""
    labels: torch.Tensor
    """(rows, width) as ``collate`` makes them."""
    state: FinetuneState
    """In tokens: rows x positions (a window is whole positions of every row)."""
    inputs: torch.Tensor
    """(rows, T, hidden) the windows slice: the virtual-token embeddings' leaf (prompt methods) + the
    token embeddings."""
    prompt_outputs: list[torch.Tensor]
    """Outputs of the prompt segment (the virtual-token embeddings, or each layer's prefix K and V)."""
    prompt_leaves: list[torch.Tensor]
    """Their detached leaves the forward used, in the same order."""
    cache: Any
    layer_outputs: list[list[torch.Tensor]] = field(default_factory=list)
    """Per layer, per window: the layer's output (graph of this layer only)."""
    layer_leaves: list[list[torch.Tensor]] = field(default_factory=list)
    """Per layer, per window: the leaf the next layer (or the head) read instead."""
    logits: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None


class CoServedJob:
    """A prompt-learning job run piecewise inside engine iterations (``coserve.FinetuneJob``)."""

    def __init__(
        self,
        trainer: Trainer,
        max_steps: int | None = None,
        served_model_dir: str | Path | None = None,
        micro_batch: int | None = None,
    ) -> None:
        """``served_model_dir``: the engine's model; a job of another model is refused (ValueError).
        ``micro_batch``: rows of one co-served sequence (default: the whole global batch); smaller ones
        make smaller backward units, which fit beside heavier inference. The gradients of a step's
        micro-batches add up to the batch's (gradient accumulation), the optimizer steps after the last."""
        if served_model_dir is not None and Path(served_model_dir).resolve() != trainer.model_dir.resolve():
            raise ValueError(
                f"the job tunes {trainer.model_dir} but the engine serves {served_model_dir}: a co-served "
                "job runs on the engine's own base model"
            )
        self.trainer = trainer
        self.model: Any = trainer.model  # a PeftModel (untyped: PEFT's prompt methods are dynamic)
        self.base = trainer.model.get_base_model()
        self.layers = decoder_layers(self.base)
        self.depth = len(self.layers)
        self.num_layers = self.depth + 1
        """Backward units for the planner: the head (final norm, LM head, loss) on top of the layers —
        its own unit, since the LM head alone outweighs a small model's decoder layer."""
        self.prefix = trainer.cfg.method == "prefixTuning"
        self.max_steps = trainer.cfg.max_iterations if max_steps is None else max_steps
        self.micro_batch = micro_batch or trainer.cfg.batch_size
        if self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1")
        self._seq: _Sequence | None = None
        self._pending: list[int] = []
        """Rows of this worker's shard of the current optimizer step not started yet."""
        self._in_step = False
        """Rows of the current step were drawn (its gradients accumulate until the step ends)."""
        self._sync: Future[np.ndarray] | None = None
        self._sync_started = 0.0
        self._pool: ThreadPoolExecutor | None = None
        self._loss_value = 0.0
        self._step_loss = 0.0
        self.tokens_trained = 0
        """Sample tokens of finished optimizer steps (pads and virtual tokens not counted)."""
        self.reason: str | None = None
        """Why the job was dropped (set by ``drop``), None while it runs."""

    # -- the planner's view
    @property
    def done(self) -> bool:
        return self.reason is not None or self.trainer.iterations >= self.max_steps

    def state(self) -> FinetuneState | None:
        """The sequence to work on (a new one is prepared when the last finished), None when done or
        while the step's gradients are being all-reduced. Never raises: the engine asks between steps."""
        if self.done:
            return None
        if self._sync is not None and not self._sync_finished():
            return None
        while self._seq is None and not self.done:
            if not self._in_step:
                self._begin_step()
            if self._pending:
                self._seq = self._start_sequence()
            else:  # an empty shard (a global batch smaller than the world) only joins the all-reduce
                self._end_step()
                if self._sync is not None and not self._sync_finished():
                    return None
        return None if self._seq is None else self._seq.state

    def run(self, plan: IterationPlan) -> int:
        """Execute the plan's finetuning share on the current batch; its cost in token equivalents.

        A forward window covers whole positions of every row (``tokens // rows`` positions): a share
        smaller than one position of the batch waits, except in an idle iteration, which always runs one.
        """
        seq = self._seq
        if seq is None:
            return 0
        cost = 0
        with torch.enable_grad():
            if plan.finetune_forward_tokens:
                rows = seq.inputs.shape[0]
                positions = plan.finetune_forward_tokens // rows or int(plan.inference_tokens == 0)
                positions = min(positions, (seq.state.sequence_tokens - seq.state.forward_done) // rows)
                if positions:
                    self._forward(seq, positions)
                    cost = positions * rows
            for layer in plan.finetune_backward_layers:
                self._backward_layer(seq, layer)
            cost += plan.finetune_cost_tokens if plan.finetune_backward_layers else 0
        if cost and self.trainer.device.type == "cuda":
            # The planner fits its latency models to the wall time of each share (FlexLLM §6.2). CUDA
            # runs kernels asynchronously: without this wait the share is timed as its launches only
            # and its GPU time is charged to the next inference step, so the fits swap (on an H200 the
            # tiny model's forward fitted 2.3 ms per token) and the windows shrink to a token or two.
            torch.cuda.synchronize(self.trainer.device)
        if seq.state.done:
            self._finish_sequence(seq)
        return cost

    def drop(self, reason: str) -> None:
        """Give the job up (its partial graph and gradients are released); the engine goes on. An
        all-reduce in flight sees the job dropped and aborts (``should_abort``)."""
        self.reason = reason
        self._seq, self._pending, self._in_step, self._sync = None, [], False, None
        self.trainer.optimizer.zero_grad(set_to_none=True)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # -- one optimizer step
    def _begin_step(self) -> None:
        """Draw the step's global batch (a function of seed and step) and take this worker's shard."""
        t = self.trainer
        batch = global_batch_indices(len(t._train_enc), t.cfg.batch_size, t.cfg.seed, t.iterations)
        shard = np.array_split(batch, t.world)[t.worker]
        self._pending, self._step_loss, self._in_step = [int(i) for i in shard], 0.0, True
        t.optimizer.zero_grad(set_to_none=True)

    def _end_step(self) -> None:
        """All rows of the shard are back-propagated: step (world 1) or start the all-reduce."""
        t = self.trainer
        if t.allreduce is None:
            t.optimizer.step()
            self._stepped(self._step_loss, 0.0)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="coserve-allreduce")
        self._sync_started = time.perf_counter()
        self._sync = self._pool.submit(
            t.allreduce.allreduce_mean, t.iterations, t._flat_grads(self._step_loss)
        )

    def _sync_finished(self) -> bool:
        """Apply the all-reduced step if it is back (True), or report it still in flight (False)."""
        assert self._sync is not None
        if not self._sync.done():
            return False
        fut, self._sync = self._sync, None
        try:
            flat = fut.result()
        except Exception as exc:
            self.drop(f"gradient all-reduce failed: {type(exc).__name__}: {exc}")
            return True
        t = self.trainer
        t._write_grads(flat[:-1])
        t.optimizer.step()
        self._stepped(float(flat[-1]), time.perf_counter() - self._sync_started)
        return True

    def _stepped(self, loss: float, sync_seconds: float) -> None:
        """``Trainer.step``'s tail: zero, history entry (the mean loss of the global batch), count."""
        t = self.trainer
        t.optimizer.zero_grad(set_to_none=True)
        self._in_step = False
        entry = {"step": t.iterations, "loss": loss, "seconds": 0.0, "sync_seconds": sync_seconds}
        t.history.append({**entry, "run": t.run_index})
        t.iterations += 1

    # -- one sequence
    def _start_sequence(self) -> _Sequence:
        """The next micro-batch of the shard, right-padded as ``collate`` pads it: with causal
        attention no real token sees a pad, and pads carry no loss, so no attention mask is needed."""
        t = self.trainer
        take, self._pending = self._pending[: self.micro_batch], self._pending[self.micro_batch :]
        rows = training_rows([t._train_enc[i] for i in take])
        ids, _, labels = collate(rows, t._pad_id, t.device)
        b = ids.shape[0]
        with torch.enable_grad():
            embeds = self.model.word_embeddings(ids).detach()
            if self.prefix:
                cache = self.model.get_prompt(batch_size=b, max_cache_len=ids.shape[1] + t.cfg.virtual_tokens)
                outputs = [x for layer in cache.layers for x in (layer.keys, layer.values)]
                leaves = [x.detach().requires_grad_() for x in outputs]
                cache = type(cache)(config=self.base.config)
                for i in range(self.depth):
                    cache.update(leaves[2 * i], leaves[2 * i + 1], i)
                inputs = embeds
            else:
                prompt = self.model.get_prompt(batch_size=b).to(embeds.dtype)
                outputs, leaves = [prompt], [prompt.detach().requires_grad_()]
                inputs = torch.cat([leaves[0], embeds], dim=1)
                cache = None
        state = FinetuneState(sequence_tokens=b * inputs.shape[1], num_layers=self.num_layers)
        return _Sequence(
            sum(len(r[0]) for r in rows), labels, state, inputs, outputs, leaves, cache,
            [[] for _ in range(self.depth)], [[] for _ in range(self.depth)],
        )  # fmt: skip

    def _forward(self, seq: _Sequence, n: int) -> None:
        """Positions ``[done, done + n)`` of every row through the frozen base, the graph kept."""
        rows = seq.inputs.shape[0]
        start = seq.state.forward_done // rows
        window = seq.inputs[:, start : start + n]

        def cut(layer: int) -> Any:
            def hook(_module: Any, _args: Any, output: Any) -> Any:
                out = output[0] if isinstance(output, tuple) else output
                leaf = out.detach().requires_grad_()
                seq.layer_outputs[layer].append(out)
                seq.layer_leaves[layer].append(leaf)
                return (leaf, *output[1:]) if isinstance(output, tuple) else leaf

            return hook

        handles = [m.register_forward_hook(cut(i)) for i, m in enumerate(self.layers)]
        try:
            out = self.base(inputs_embeds=window, use_cache=True, **cache_kwargs(self.base, seq.cache))
        finally:
            for h in handles:
                h.remove()
        seq.cache = output_cache(out)
        seq.logits.append(out.logits)
        seq.state.forward_done += n * rows
        if not seq.state.in_forward:
            seq.loss = self._loss(seq)

    def _loss(self, seq: _Sequence) -> torch.Tensor:
        """``per_sample_loss`` summed and scaled as ``Trainer.step`` does (÷ the global batch size)."""
        losses = logits_loss(torch.cat(seq.logits, dim=1), seq.labels)
        loss = losses.sum() * (self.trainer.world / self.trainer.cfg.batch_size)
        self._loss_value = float(loss.detach())
        return loss

    def _backward_layer(self, seq: _Sequence, unit: int) -> None:
        """Backward unit ``unit``: the head (``unit == depth``) or decoder layer ``unit``; layer 0 also
        back-propagates the prompt segment into the trainable parameters."""
        if unit == self.depth:
            assert seq.loss is not None, "backward before the forward finished"
            seq.loss.backward()  # into the last layer's output leaves
            seq.loss, seq.logits = None, []
            seq.state.backward_done += 1
            return
        leaves = seq.layer_leaves[unit]
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        torch.autograd.backward(seq.layer_outputs[unit], grads)
        seq.layer_outputs[unit], seq.layer_leaves[unit] = [], []
        if unit == 0:
            pairs = [(o, leaf.grad) for o, leaf in zip(seq.prompt_outputs, seq.prompt_leaves, strict=True)]
            pairs = [(o, g) for o, g in pairs if g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            seq.prompt_outputs = []
        seq.state.backward_done += 1

    def _finish_sequence(self, seq: _Sequence) -> None:
        """A micro-batch is back-propagated: its gradients accumulate; the last of the shard ends the step."""
        self._seq = None
        self.tokens_trained += seq.tokens
        self._step_loss += self._loss_value
        if not self._pending:
            self._end_step()
