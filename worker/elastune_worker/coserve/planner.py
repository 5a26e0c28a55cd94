"""FlexLLM's hybrid token scheduler (§6.2), the pure planning half: how many finetuning tokens (forward)
or layers (backward) of a co-served tuning job ride along each inference iteration without the iteration
exceeding its latency target.

Each iteration first takes its inference tokens (the engine's scheduler: decodes, then prefill chunks);
the leftover of the target goes to finetuning. The target is the pool's TPOT SLO times a headroom. The
latency model — seconds = base + per_token × tokens — starts from the engine's profiled fit and is
refitted online (least squares over a window of observed iterations), as the issue asks; FlexLLM
profiles f(c, s) offline.

The finetuning side follows FlexLLM's token-level finetuning (§6.1, Alg. 2): the forward pass in token
windows of size s = max{s : f(c + s) ≤ target}; then the backward pass layer by layer, last layer
first, spread over the following iterations — a layer's backward over the whole sequence costs
``backward_factor`` × its forward (a prompt-learning backward: activations' gradients only, no weight
gradients of the frozen base), and an iteration takes as many whole layers as fit. Interpretation: the
paper windows the backward by tokens too; with our small models a layer is the natural unit, which the
issue names ("its backward spread over the following iterations layer by layer").

No torch here (import-linter keeps it pure).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class LatencyModel:
    """Iteration seconds ≈ base + per_token × tokens, refitted from observations, and never less than
    the cheapest observation of the window (``floor``).

    The floor is for a cost the line misses: a co-served share on a GPU runs a second model eagerly,
    whose fixed cost (inferred, not profiled) outweighs its per-token cost, while its windows span a
    narrow range of sizes. On an H200 at 8B the least-squares line through such shares came out as
    slope only (2.4 ms a forward token, intercept clamped at 0), so one-token windows were predicted at
    2.4 ms and planned beside the inference tokens, and the iterations missed the TPOT SLO (inference
    TPOT p50 82 ms against 11 ms alone, SLO attainment 0.5 % against 99 %). No share costs less than
    the cheapest one seen."""

    base: float
    per_token: float
    window: int = 256
    samples: deque[tuple[int, float]] = field(default_factory=deque)
    floor: float = 0.0

    def __post_init__(self) -> None:
        if self.base < 0 or self.per_token <= 0 or self.window < 2:
            raise ValueError("need base >= 0, per_token > 0 and window >= 2")

    def observe(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        while len(self.samples) > self.window:
            self.samples.popleft()
        self._refit()

    def _refit(self) -> None:
        n = len(self.samples)
        self.floor = min(sec for _, sec in self.samples)
        if n < 2:
            return
        mx = sum(t for t, _ in self.samples) / n
        my = sum(s for _, s in self.samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self.samples)
        if sxx == 0:  # one token count seen so far: keep the slope, move the intercept
            self.base = max(0.0, my - self.per_token * mx)
            return
        slope = sum((t - mx) * (s - my) for t, s in self.samples) / sxx
        if slope > 0:
            self.per_token = slope
            self.base = max(0.0, my - slope * mx)

    def predict(self, tokens: int) -> float:
        return max(self.base + self.per_token * tokens, self.floor)

    def max_tokens_within(self, target_s: float) -> int:
        """The most tokens an iteration may hold and still be predicted within ``target_s``."""
        if target_s <= self.base or target_s < self.floor:
            return 0
        return int((target_s - self.base) / self.per_token + 1e-9)  # no float crumbs below a whole token


@dataclass
class FinetuneState:
    """Where one co-served finetuning sequence is: forward tokens left, then backward layers left."""

    sequence_tokens: int
    num_layers: int
    forward_done: int = 0
    backward_done: int = 0
    """Layers whose backward has run (counted from the last layer)."""

    def __post_init__(self) -> None:
        if self.sequence_tokens < 1 or self.num_layers < 1:
            raise ValueError("a finetuning sequence needs >= 1 token and >= 1 layer")

    @property
    def in_forward(self) -> bool:
        return self.forward_done < self.sequence_tokens

    @property
    def done(self) -> bool:
        return not self.in_forward and self.backward_done >= self.num_layers


@dataclass(frozen=True)
class IterationPlan:
    target_s: float
    inference_tokens: int
    finetune_forward_tokens: int = 0
    """Tokens of the finetuning sequence's forward this iteration (a window, positions continue)."""
    finetune_backward_layers: tuple[int, ...] = ()
    """Layer indices whose backward runs this iteration, last layer first."""
    predicted_s: float = 0.0
    finetune_cost_tokens: int = 0
    """The finetuning share in forward-token equivalents (what the latency model is fed with)."""


@dataclass(frozen=True)
class CoServeConfig:
    tpot_slo_s: float
    """The pool's TPOT SLO: one iteration produces one token of every decoding request."""
    headroom: float = 0.9
    """The iteration target is this share of the SLO (room for the model's error)."""
    max_window: int = 512
    """Most finetuning tokens per iteration (FlexLLM's window cap; bounds activation memory)."""
    backward_factor: float = 2.0
    """A layer's backward over the sequence ≈ this × its forward (recompute + activation gradients)."""

    def __post_init__(self) -> None:
        if (
            self.tpot_slo_s <= 0
            or not 0 < self.headroom <= 1
            or self.max_window < 1
            or self.backward_factor <= 0
        ):
            raise ValueError("need tpot_slo_s > 0, 0 < headroom <= 1, max_window >= 1, backward_factor > 0")


class CoServePlanner:
    """``model`` predicts the inference part of an iteration. With ``forward`` and ``backward`` models
    the finetuning share is predicted by its own lines (seconds vs token equivalents), fitted online
    from the time the share itself took: a separable f(c, s) = f_inf(c) + f_ft(s), where FlexLLM
    profiles f(c, s) offline. Without them one line covers inference and finetuning tokens alike — on
    a CPU that underestimates a finetuning window, which pays a per-call cost the engine's tokens do
    not."""

    def __init__(
        self,
        config: CoServeConfig,
        model: LatencyModel,
        forward: LatencyModel | None = None,
        backward: LatencyModel | None = None,
    ) -> None:
        if (forward is None) != (backward is None):
            raise ValueError("give both finetuning models (forward and backward) or neither")
        self.config, self.model = config, model
        self.forward, self.backward = forward, backward

    @property
    def target_s(self) -> float:
        return self.config.tpot_slo_s * self.config.headroom

    def _fit(self, share: LatencyModel | None, inference_tokens: int) -> int:
        if share is None:
            return max(0, self.model.max_tokens_within(self.target_s) - inference_tokens)
        return share.max_tokens_within(self.target_s - self.model.predict(inference_tokens))

    def _predict(self, share: LatencyModel | None, inference_tokens: int, cost: int) -> float:
        if share is None:
            return self.model.predict(inference_tokens + cost)
        return self.model.predict(inference_tokens) + share.predict(cost)

    def spare_tokens(self, inference_tokens: int) -> int:
        """Token budget left for finetuning beside ``inference_tokens`` (what a serving pod reports as
        its co-serving capacity)."""
        return self._fit(self.forward, inference_tokens)

    def plan(self, inference_tokens: int, job: FinetuneState | None) -> IterationPlan:
        """This iteration's finetuning share. Inference is never cut: when its own tokens already
        exceed the target, finetuning gets nothing; an idle iteration (no inference) always makes
        progress."""
        target = self.target_s
        idle = inference_tokens == 0
        nothing = IterationPlan(target, inference_tokens, predicted_s=self.model.predict(inference_tokens))
        if job is None or job.done:
            return nothing
        if job.in_forward:
            spare = max(self.spare_tokens(inference_tokens), int(idle))
            window = min(spare, self.config.max_window, job.sequence_tokens - job.forward_done)
            if window == 0:
                return nothing
            return IterationPlan(
                target, inference_tokens, finetune_forward_tokens=window, finetune_cost_tokens=window,
                predicted_s=self._predict(self.forward, inference_tokens, window),
            )  # fmt: skip
        # Backward: whole layers, each worth backward_factor x (sequence / layers) forward tokens.
        spare = self._fit(self.backward, inference_tokens)
        per_layer = self.config.backward_factor * job.sequence_tokens / job.num_layers
        fit = int(spare // per_layer) if per_layer > 0 else 0
        n = min(max(fit, int(idle)), job.num_layers - job.backward_done)
        if n == 0:
            return nothing
        first = job.num_layers - 1 - job.backward_done
        layers = tuple(range(first, first - n, -1))
        cost = round(n * per_layer)
        return IterationPlan(
            target, inference_tokens, finetune_backward_layers=layers,
            predicted_s=self._predict(self.backward, inference_tokens, cost), finetune_cost_tokens=cost,
        )  # fmt: skip

    def observe(self, plan: IterationPlan, ran: int, inference_s: float, finetune_s: float) -> None:
        """Refit from an iteration that ran ``plan`` (``ran`` token equivalents of finetuning) in
        ``inference_s`` + ``finetune_s`` seconds."""
        if self.forward is None or self.backward is None:
            self.model.observe(plan.inference_tokens + ran, inference_s + finetune_s)
            return
        if plan.inference_tokens:
            self.model.observe(plan.inference_tokens, inference_s)
        if ran:
            share = self.forward if plan.finetune_forward_tokens else self.backward
            share.observe(ran, finetune_s)

    @staticmethod
    def advance(job: FinetuneState, plan: IterationPlan) -> None:
        """Record what the iteration ran of ``job``."""
        job.forward_done += plan.finetune_forward_tokens
        job.backward_done += len(plan.finetune_backward_layers)


class FinetuneJob(Protocol):
    """What the engine needs of a co-served job (job.CoServedJob is the torch one)."""

    def state(self) -> FinetuneState | None:
        """The sequence in progress, None when the job has nothing left to run."""
        ...

    def run(self, plan: IterationPlan) -> int:
        """Run the plan's finetuning share (or less, never more), advance ``state()`` accordingly, and
        return what ran in forward-token equivalents."""
        ...

    def drop(self, reason: str) -> None:
        """Give the job up after a failure; the engine serves on without it."""
        ...
