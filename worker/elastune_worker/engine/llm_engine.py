"""The engine core, in the shape of vLLM's EngineCore and nano-vllm: ``add_request`` / ``step`` /
``abort``. Each step schedules (core/scheduler.py), runs one batched forward (model_runner/runner.py),
appends the sampled tokens, detokenizes and decides which requests finished; a step hook (hooks.py:
co-serving) takes its share of the iteration after the forward."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastune_contract.protocol import ServingCost
from elastune_worker.engine.core.adapter_ref import (
    DEFAULT_NAMESPACE,
    AdapterInfo,
    AdapterKind,
    AdapterRef,
    adapter_key,
)
from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.core.outputs import RequestOutput
from elastune_worker.engine.core.sampling import SamplingParams
from elastune_worker.engine.core.scheduler import Scheduler, SchedulerOutput
from elastune_worker.engine.core.sequence import Sequence
from elastune_worker.engine.detokenizer import IncrementalDetokenizer
from elastune_worker.engine.hooks import StepHook
from elastune_worker.engine.model_runner.lora.manager import LoRAManager
from elastune_worker.engine.model_runner.lora.storage import resolve_artifact
from elastune_worker.engine.model_runner.lora.weights import AdapterError, LoRAWeights
from elastune_worker.engine.model_runner.models.loader import eos_token_ids
from elastune_worker.engine.model_runner.runner import ModelRunner
from elastune_worker.engine.model_runner.soft_prompts import (
    PLACEHOLDER_TOKEN,
    SoftPrompt,
    is_prompt_learning,
    load_soft_prompt,
)

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    """Time spent in steps so far."""
    coserve_seconds: float = 0.0
    """Of which the step hook's share (co-served finetuning; the rest is inference)."""
    loras: tuple[AdapterInfo, ...] = ()
    """Loaded adapters and their tier now (device | host | storage)."""
    max_loras: int = 0
    """Device adapter slots (0: LoRA not enabled)."""
    lora_running: dict[str, int] = field(default_factory=dict)
    """Running requests per LoRA adapter, by its key (an adapter in use is never unloaded or moved)."""
    lora_waiting: dict[str, int] = field(default_factory=dict)
    lora_counters: dict[str, float] = field(default_factory=dict)
    """Cumulative adapter loads, load seconds and evictions per tier, and CPU-assisted prefill steps."""
    extra: dict[str, float] = field(default_factory=dict)


class LLMEngine:
    def __init__(
        self, model_path: str | Path, config: EngineConfig | None = None, tokenizer: Any = None
    ) -> None:
        self.config = config or EngineConfig()
        self.model_path = Path(model_path)
        self.runner = ModelRunner(self.model_path, self.config)
        # The cache the runner allocated (on CUDA sized from free memory) is what the scheduler hands out.
        self.config = dataclasses.replace(self.config, num_kv_blocks=self.runner.num_kv_blocks)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        self.tokenizer = tokenizer
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(self.model_path, self.runner.hf_config, tokenizer.eos_token_id)
        self.scheduler = Scheduler(self.config.scheduler_config(), self.max_model_len)
        self._adapters: dict[str, AdapterRef] = {}
        """The loaded adapters (LoRAs and soft prompts) by key: what a request's reference is checked
        against."""
        self._adapter_ids = itertools.count(1)
        self.soft_prompts: dict[str, SoftPrompt] = {}
        """By adapter key (the runner reads a sequence's soft prompt here)."""
        self.loras: LoRAManager | None = None
        if self.config.enable_lora:
            self.loras = self.runner.enable_loras(self.config)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._steps = 0
        self._step_seconds = 0.0
        self._coserve_seconds = 0.0
        self._hook: StepHook | None = None
        self.cpu_assisted_steps = 0
        self.cpu_assisted_prefills = 0
        """Steps whose cold adapters' deltas were computed on the CPU while their copy was in flight."""
        self.cost: ServingCost | None = None
        """The profiled cost lines (set by the process that profiled it): the co-serving planner's start."""
        self.hooks_dropped: list[tuple[StepHook, str]] = []
        """Step hooks detached after they raised, with the reason."""

    # -- requests -----------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        extra_key: str | None = None,
        adapter: AdapterRef | None = None,
        tenant: str = "",
    ) -> None:
        """Queue a request, served with ``adapter`` (resolved from its served name: ``adapter_ref``), for
        ``tenant`` (whom the ``fair`` queue policy shares service across; "" for none).
        ValueError (nothing allocated) for an empty prompt, one that leaves no room in the context,
        token ids outside the vocabulary, or an adapter that is not loaded (any more)."""
        params = params or SamplingParams()
        if adapter is not None and self._adapters.get(adapter.key) != adapter:
            raise AdapterError(f"adapter {adapter.name!r} cannot serve: {self._not_loaded(adapter)}")
        soft = self.soft_prompts[adapter.key] if adapter is not None and not adapter.is_lora else None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        virtual = soft.num_virtual_tokens if soft is not None else 0
        if virtual + len(ids) >= self.max_model_len:
            extra = f" ({virtual} virtual tokens of its soft prompt included)" if virtual else ""
            raise ValueError(
                f"the prompt has {virtual + len(ids)} tokens{extra}; the model's context is "
                f"{self.max_model_len} tokens"
            )
        # The prefix cache keys blocks by adapter or soft prompt too: the same tokens have other K/V
        # (and by its load: other weights loaded under the same name later never reuse them).
        if adapter is not None:
            extra_key = f"{adapter.kind}:{adapter.key}#{adapter.id}/{extra_key or ''}"
        seq = Sequence(
            request_id,
            [PLACEHOLDER_TOKEN] * virtual + ids,
            params,
            arrival=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            extra_key=extra_key,
            adapter=adapter,
            num_virtual_tokens=virtual,
            tenant=tenant,
        )
        self.scheduler.add(seq)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is not in the engine."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.request_ids()

    def has_work(self) -> bool:
        """Requests to run, or a step hook with work left (it runs in otherwise idle iterations)."""
        return self.has_unfinished() or self.hook_pending()

    def hook_pending(self) -> bool:
        """The step hook has work now (a failing hook is dropped here too: the loop asks this)."""
        if self._hook is None:
            return False
        try:
            return self._hook.pending()
        except Exception as exc:
            self._drop_hook(f"{type(exc).__name__}: {exc}")
            return False

    # -- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration. A failure that belongs to one request (its sampling, its adapter's activation,
        a soft prompt or adapter gone) ends that request alone, with an output carrying ``error``;
        anything else raises (the caller fails what is in flight)."""
        t0 = time.perf_counter()
        if self.loras is not None:
            self._prepare_loras()
        out = self.scheduler.schedule()
        hook = self._hook
        if not out.chunks and hook is None:
            return []
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        if out.chunks:
            slots, host = None, None
            self._check_adapters(out, failed)
            if self.loras is not None:
                names = {c.seq.lora for c in out.chunks if c.seq.lora is not None}
                if names:
                    busy = self.scheduler.running_loras()
                    slots = self._activate(names, busy, out, failed)
                    names = {c.seq.lora for c in out.chunks if c.seq.lora is not None}
                    host = self._cold_adapters(names) if names else None
                    if host:
                        self._count_cpu_assisted(out, host)
            if out.chunks:
                sampled = self.runner.execute(out, slots, self.soft_prompts or None, host)
                failed.update(self.runner.take_sampling_failures())
        ft_start = time.perf_counter()
        ran, finetune = self._hook_share(out.num_tokens) if hook is not None else (False, 0)
        ft_s = time.perf_counter() - ft_start  # the hook's share alone, for its latency model
        if not out.chunks and not finetune and not failed:
            return []
        outputs = []
        for seq in self.scheduler.update(out, sampled):
            if seq.request_id not in failed:
                outputs.append(self._emit(seq))
        for rid, why in failed.items():
            outputs.append(self._fail(rid, why))
        self._steps += 1
        elapsed = time.perf_counter() - t0
        self._step_seconds += elapsed
        self._coserve_seconds += ft_s if hook is not None else 0.0
        if hook is not None and ran:  # the online refit (FlexLLM §6.2)
            hook.observe(elapsed - ft_s, ft_s)
        return outputs

    def _check_adapters(self, out: SchedulerOutput, failed: dict[str, str]) -> None:
        """Drop (and fail) the chunks whose soft prompt or adapter is no longer loaded."""
        for c in out.chunks:
            a = c.seq.adapter
            if a is not None and self._adapters.get(a.key) != a:
                what = "adapter" if a.is_lora else "soft prompt"
                failed[c.seq.request_id] = f"{what} {a.name!r} is no longer loaded"
        if failed:
            out.chunks = [c for c in out.chunks if c.seq.request_id not in failed]

    def _activate(
        self, names: set[str], busy: set[str], out: SchedulerOutput, failed: dict[str, str]
    ) -> dict[str, int]:
        """Device slots of this step's adapters. An adapter that fails to activate (its weights
        unreadable from storage, a copy failing) fails the requests that use it, not the step."""
        assert self.loras is not None
        try:
            return self.loras.activate(names, busy)
        except Exception as exc:
            if len(names) == 1:
                bad = {n: exc for n in names}
            else:  # which one: each alone
                bad = {}
                for n in sorted(names):
                    try:
                        self.loras.activate({n}, busy)
                    except Exception as one:
                        bad[n] = one
                if not bad:
                    raise  # only together: not one adapter's fault
        log.warning("adapters %s failed to activate: %s", sorted(bad), bad)
        for c in out.chunks:
            if c.seq.lora in bad:
                why = bad[c.seq.lora]
                failed[c.seq.request_id] = (
                    f"adapter {c.seq.lora!r} failed to load: {type(why).__name__}: {why}"
                )
        out.chunks = [c for c in out.chunks if c.seq.request_id not in failed]
        rest = names - set(bad)
        return self.loras.activate(rest, busy - set(bad)) if rest else {}

    def _fail(self, request_id: str, why: str) -> RequestOutput:
        """End one request with an error (its KV blocks freed); the step goes on for the others."""
        seq = self.scheduler.get(request_id)
        log.warning("request %s failed in a step: %s", request_id, why)
        if seq is None:
            return RequestOutput(request_id, [], "", True, "abort", 0, 0, 0, error=why)
        output = RequestOutput(
            request_id,
            [],
            "",
            True,
            "abort",
            len(seq.prompt_token_ids) - seq.num_virtual_tokens,
            len(seq.output_token_ids),
            seq.num_cached_tokens,
            error=why,
        )
        self._finish(seq, "abort")
        return output

    # -- the step hook (co-serving) -----------------------------------------------------------------
    def attach_hook(self, hook: StepHook) -> None:
        """Every step gives ``hook`` its share beside the inference tokens (one hook at a time)."""
        self._hook = hook

    def detach_hook(self) -> StepHook | None:
        hook, self._hook = self._hook, None
        return hook

    def _hook_share(self, inference_tokens: int) -> tuple[bool, int]:
        """Run this iteration's hook share: whether it ran and what ran in token equivalents. A failing
        hook is dropped with its reason and detached: inference never fails because of it."""
        assert self._hook is not None
        try:
            return True, self._hook.run(inference_tokens)
        except Exception as exc:
            self._drop_hook(f"{type(exc).__name__}: {exc}")
            return False, 0

    def _drop_hook(self, reason: str) -> None:
        """Detach the failing hook and tell it why; inference never fails because of it."""
        assert self._hook is not None
        hook, self._hook = self._hook, None
        log.warning("dropping the step hook: %s", reason)
        self.hooks_dropped.append((hook, reason))
        try:
            hook.drop(reason)
        except Exception:  # its cleanup failing must not fail the step either
            log.exception("dropping the step hook failed")

    def _emit(self, seq: Sequence) -> RequestOutput:
        tok, p = seq.output_token_ids[-1], seq.params
        text, stopped = self._detok[seq.request_id].add(tok)
        reason = None
        if stopped or tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            reason = "stop"
        elif self.scheduler.reached_length(seq):
            reason = "length"
        if reason is not None:
            if not stopped:
                text += self._detok[seq.request_id].flush()
            self._finish(seq, reason)
        return RequestOutput(
            seq.request_id,
            [tok],
            text,
            reason is not None,
            reason,
            len(seq.prompt_token_ids) - seq.num_virtual_tokens,
            len(seq.output_token_ids),
            seq.num_cached_tokens,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._detok.pop(seq.request_id, None)
        self.runner.forget_request(seq.request_id)

    # -- adapters -----------------------------------------------------------------------------------
    def _prepare_loras(self) -> None:
        """Before scheduling: start loading the adapters the queue's head needs (async, cpu_assisted) and,
        for async, hold back requests whose adapter is not on the device yet."""
        assert self.loras is not None
        mode = self.config.lora_load_mode
        if mode in ("async", "cpu_assisted"):
            self.loras.prefetch(self.scheduler.waiting_loras(32), self.scheduler.running_loras())
        self.scheduler.hold_loras(self.loras.not_ready() if mode == "async" else set())

    def _cold_adapters(self, names: set[str]) -> dict[str, LoRAWeights] | None:
        """This step's adapters whose copy is in flight: cpu_assisted computes their deltas from the
        host copy (CaraServe); ondmd waits here for the copy to finish."""
        assert self.loras is not None
        loading = self.loras.device.loading() & names
        if not loading:
            return None
        if self.config.lora_load_mode == "ondmd":
            self.loras.device.wait_copies(loading)  # on demand: the whole step waits for the copy
            return None
        if self.config.lora_load_mode == "cpu_assisted":
            self.cpu_assisted_steps += 1
            return {n: self.loras.host.get(n) for n in loading}
        return None

    def _count_cpu_assisted(self, out: SchedulerOutput, host: dict[str, LoRAWeights]) -> None:
        """Requests whose prefill runs CPU-assisted in this step, each counted once."""
        for c in out.chunks:
            seq = c.seq
            if seq.lora in host and not seq.cpu_assisted and c.start < len(seq.prompt_token_ids):
                seq.cpu_assisted = True
                self.cpu_assisted_prefills += 1

    def load_lora(self, name: str, path: str, namespace: str = DEFAULT_NAMESPACE) -> AdapterInfo:
        """vLLM's load_lora_adapter: read and check the adapter (a LoRA or a soft prompt: the artifact
        says which) into host memory; a LoRA goes to the device with its first request. AdapterError
        (the caller's 400) when it cannot serve here. Loading a loaded one again keeps its reference."""
        key = adapter_key(namespace, name)
        local = resolve_artifact(path)
        known = self._adapters.get(key)
        if is_prompt_learning(local):
            if known is not None and known.is_lora:
                raise AdapterError(f"{name!r} is already loaded as a LoRA adapter")
            r = self.runner
            sp = load_soft_prompt(name, local, r.hidden_size, r.device, r.dtype)
            self.soft_prompts[key] = sp
            return AdapterInfo(self._register(known, "soft_prompt", namespace, name), sp.path, 0, "device")
        if self.loras is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        if known is not None and not known.is_lora:
            raise AdapterError(f"{name!r} is already loaded as a soft prompt")
        reg = self.loras.register(key, local)
        ref = self._register(known, "lora", namespace, name)
        return AdapterInfo(ref, reg.path, reg.rank, self.loras.tier(key))

    def add_lora_weights(self, weights: LoRAWeights, namespace: str = DEFAULT_NAMESPACE) -> AdapterRef:
        """Serve LoRA weights already in memory (the start-up profile's synthetic adapters) under
        ``weights.name``; ``unload_lora`` takes them away."""
        if self.loras is None:
            raise AdapterError("LoRA is not enabled on this engine (start it with --enable-lora)")
        key = adapter_key(namespace, weights.name)
        if key in self._adapters:
            raise AdapterError(f"{weights.name!r} is already loaded")
        self.loras.register_weights(weights)
        return self._register(None, "lora", namespace, weights.name)

    def _register(self, known: AdapterRef | None, kind: AdapterKind, namespace: str, name: str) -> AdapterRef:
        if known is not None:
            return known
        ref = AdapterRef(kind, namespace, name, next(self._adapter_ids))
        self._adapters[ref.key] = ref
        return ref

    def unload_lora(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> None:
        """KeyError when it is not loaded; AdapterError while requests use it."""
        key = adapter_key(namespace, name)
        ref = self._adapters.get(key)
        if ref is None:
            raise KeyError(name)
        users = self.scheduler.adapter_users(key)
        if not ref.is_lora:
            if users:
                raise AdapterError(
                    f"soft prompt {name!r} is in use by {users} request(s); unload it when they finish"
                )
            del self.soft_prompts[key]
        else:
            assert self.loras is not None  # a LoRA was registered: LoRA is enabled
            self.loras.unregister(key, users)
            self.runner.forget_adapter(key)
        del self._adapters[key]

    def adapter_ref(self, name: str, namespace: str = DEFAULT_NAMESPACE) -> AdapterRef:
        """The adapter served as ``name`` in ``namespace`` (the key the API's ``resolve`` finds in the
        engine's stats), for callers of the engine itself: scripts, benchmarks. AdapterError when none
        is loaded."""
        ref = self._adapters.get(adapter_key(namespace, name))
        if ref is None:
            why = "LoRA is not enabled on this engine" if self.loras is None else "it is not loaded"
            raise AdapterError(f"adapter {name!r} cannot serve: {why}")
        return ref

    def _not_loaded(self, ref: AdapterRef) -> str:
        if ref.is_lora and self.loras is None:
            return "LoRA is not enabled on this engine"
        if ref.key in self._adapters:
            return "it was unloaded and loaded again since the request named it"
        return "it is not loaded"

    def list_loras(self) -> list[AdapterInfo]:
        """LoRA adapters, then soft prompts (rank 0, always on the device: a few embedding rows)."""
        loras, soft = [], []
        for ref in self._adapters.values():
            if ref.is_lora:
                assert self.loras is not None
                reg = self.loras.registration(ref.key)
                loras.append(AdapterInfo(ref, reg.path, reg.rank, self.loras.tier(ref.key)))
            else:
                soft.append(AdapterInfo(ref, self.soft_prompts[ref.key].path, 0, "device"))
        return loras + soft

    # -- conveniences -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[list[int]]:
        """All prompts together (each with the adapter or soft prompt served under its name in
        ``adapters``), stepped to the end; the generated token ids of each, in order."""
        ids = [f"gen-{i}" for i in range(len(prompts))]
        names = adapters or [None] * len(prompts)
        for rid, prompt, name in zip(ids, prompts, names, strict=True):
            ref = self.adapter_ref(name) if name is not None else None
            self.add_request(rid, prompt, params, adapter=ref)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                tokens[o.request_id] += o.new_token_ids
        return [tokens[rid] for rid in ids]

    def reset_counters(self) -> None:
        """Forget start-up work (profiling): its cached blocks and its statistics."""
        self.scheduler.reset_counters()
        self._steps, self._step_seconds = 0, 0.0

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_requests_running=s.running,
            num_requests_waiting=s.waiting,
            kv_cache_usage_perc=s.kv_cache_usage,
            prefix_cache_queries_tokens=s.prefix_cache_queried_tokens,
            prefix_cache_hits_tokens=s.prefix_cache_hit_tokens,
            preemptions=s.preemptions,
            steps=self._steps,
            step_seconds=self._step_seconds,
            coserve_seconds=self._coserve_seconds,
            loras=tuple(self.list_loras()),
            max_loras=self.config.max_loras if self.loras is not None else 0,
            lora_running=s.lora_running,
            lora_waiting=s.lora_waiting,
            lora_counters=self._lora_counters(),
        )

    def _lora_counters(self) -> dict[str, float]:
        if self.loras is None:
            return {}
        return {
            **self.loras.counters(),
            "cpu_assisted_steps": self.cpu_assisted_steps,
            "cpu_assisted_prefills": self.cpu_assisted_prefills,
        }
