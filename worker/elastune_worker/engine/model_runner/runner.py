"""Runs the model for one scheduled step: builds the flat batch and the attention metadata from the
scheduler's chunks, runs one forward over the paged KV cache, samples the next tokens.

On CUDA, decode-only steps replay captured CUDA graphs (cuda_graphs.py) and the KV cache takes the
device memory left after the weights and a warm-up forward, unless a size is given."""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from elastune_worker.engine.core.config import EngineConfig, LoraKernelName
from elastune_worker.engine.core.scheduler import SchedulerOutput
from elastune_worker.engine.model_runner import triton_attention
from elastune_worker.engine.model_runner.attention import AttentionMetadata, DecodeGroup, paged_attention
from elastune_worker.engine.model_runner.cuda_graphs import DecodeGraphs
from elastune_worker.engine.model_runner.fused_ops import TORCH_OPS, ElementwiseOps, pick_elementwise_backend
from elastune_worker.engine.model_runner.lora import sgmv
from elastune_worker.engine.model_runner.lora.cpu_workers import CpuLoRAPool
from elastune_worker.engine.model_runner.lora.kernels import LoRABatch
from elastune_worker.engine.model_runner.lora.manager import LoRAManager
from elastune_worker.engine.model_runner.lora.slots import DeviceLoRAs
from elastune_worker.engine.model_runner.lora.weights import LoRAWeights
from elastune_worker.engine.model_runner.models.loader import context_length, load_model
from elastune_worker.engine.model_runner.sampler import Sampler
from elastune_worker.engine.model_runner.soft_prompts import SoftPrompt
from elastune_worker.engine.model_runner.triton_choice import choose_triton, triton_unusable

log = logging.getLogger(__name__)

AttentionBackend = Literal["gather", "triton"]
PREFIX_TILE_TOKENS = 16
"""Query tokens per Triton tile of a prefill chunk over a cached prefix."""


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(choice)


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[choice]


class ModelRunner:
    def __init__(self, path: Path, config: EngineConfig) -> None:
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.model, self.hf_config = load_model(Path(path), self.device, self.dtype)
        native = context_length(self.hf_config)
        self.max_model_len = min(config.max_model_len or native, native)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.hidden_size = int(self.hf_config.get("hidden_size") or self.hf_config["n_embd"])
        self.attention_backend = pick_attention_backend(config.attention_backend, self.device, self.dtype)
        self.elementwise: ElementwiseOps = TORCH_OPS
        """The norms, RoPE and SiLU-and-mul the model runs (fused Triton kernels or torch ops)."""
        use_elementwise = getattr(self.model, "use_elementwise", None)
        if use_elementwise is not None:  # Llama-family models; GPT-2 keeps its torch ops
            shape = self.model.elementwise_shape()  # type: ignore[operator]
            choice = config.elementwise_backend
            self.elementwise = pick_elementwise_backend(choice, self.device, self.dtype, shape)
            use_elementwise(self.elementwise)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = self._kv_blocks(config)
        """Blocks this cache holds for sequences: the engine's scheduler should hand out this many."""
        self._fit_context(config)
        # Until every scheduler is built from num_kv_blocks, it may hand out config.kv_blocks() blocks:
        # the cache holds at least that many, then the scratch block that the padding rows of a CUDA
        # graph write to, past any block a scheduler can own.
        held = max(self.num_kv_blocks, config.kv_blocks())
        self.kv_caches = self._alloc_kv(held + 1)
        self.scratch_slot = held * self.block_size
        if self.attention_backend == "triton" and self.device.type == "cuda":
            self.compile_or_fall_back()
        self.use_cuda_graphs = config.cuda_graphs and self.device.type == "cuda"
        if config.cuda_graphs and self.device.type != "cuda":
            log.info("cuda_graphs ignored: the engine runs on %s (eager)", self.device.type)
        elif self.use_cuda_graphs and self.attention_backend != "triton":
            log.warning("CUDA graphs off: they need the triton attention backend (this engine uses gather)")
            self.use_cuda_graphs = False
        self.cuda_graph_max_batch = min(config.cuda_graph_max_batch, config.max_num_seqs)
        self.graphs: DecodeGraphs | None = None
        """Captured at the first decode step (after the engine has set the LoRA slots)."""
        self.graph_factory: type[DecodeGraphs] = DecodeGraphs
        self.steps_replayed = 0
        self.steps_eager = 0
        """Forward passes replayed from a CUDA graph and run eagerly (benchmarks report both)."""
        self.sampler = Sampler(self.device)
        self.lora_device: DeviceLoRAs | None = None  # set by enable_loras
        self.lora_kernel: LoraKernelName = config.lora_kernel
        self.lora_backend: sgmv.LoraBackend = "torch"  # set by enable_loras
        self.lora_cpu_pool: CpuLoRAPool | None = None  # set by enable_loras with CPU LoRA workers

    def enable_loras(self, config: EngineConfig) -> LoRAManager:
        """The adapter tiers for this model on this device (its LoRA shapes, the device slots the steps
        read) and, for CaraServe's CPU path in worker processes, their pool."""
        shapes = self.model.lora_shapes()
        loras = LoRAManager(config, shapes, self.model.num_layers, self.device, self.dtype)
        self.lora_device = loras.device
        rank = config.max_lora_rank
        self.lora_backend = sgmv.pick_lora_backend(config.lora_backend, self.device, self.dtype, shapes, rank)
        if self.lora_backend == "triton" and self.device.type == "cuda":
            self.compile_lora_or_fall_back()
        if config.lora_cpu_workers and config.lora_load_mode == "cpu_assisted":
            dims = [d for shape in self.model.lora_shapes().values() for d in shape]
            self.lora_cpu_pool = CpuLoRAPool(
                config.lora_cpu_workers, config.max_num_batched_tokens, max(dims)
            )
        return loras

    def forget_adapter(self, key: str) -> None:
        """An adapter was unloaded: the CPU LoRA workers drop their copy."""
        if self.lora_cpu_pool is not None:
            self.lora_cpu_pool.forget(key)

    def take_sampling_failures(self) -> dict[str, str]:
        """Requests whose sampling failed in the last step (each request's fault stays its own)."""
        return self.sampler.take_failures()

    def forget_request(self, request_id: str) -> None:
        """A request left the engine: its sampling state (seeded generators, penalties) goes."""
        self.sampler.forget(request_id)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        lora_slots: dict[str, int] | None = None,
        soft_prompts: dict[str, SoftPrompt] | None = None,
        host_loras: dict[str, LoRAWeights] | None = None,
    ) -> dict[str, int]:
        """Forward the step's chunks; the sampled next token of every chunk that reached its end.
        ``lora_slots``: the device slot of each adapter the step's requests use; ``soft_prompts``: the
        soft prompts they name."""
        logits, sampling = self.forward(out, lora_slots, soft_prompts, host_loras)
        ids = self.sampler.sample(logits, [(s.request_id, s.params) for s in sampling])
        return {s.request_id: t for s, t in zip(sampling, ids, strict=True)}

    def forward(
        self,
        out: SchedulerOutput,
        lora_slots: dict[str, int] | None = None,
        soft_prompts: dict[str, SoftPrompt] | None = None,
        host_loras: dict[str, LoRAWeights] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """The logits of every chunk that reached its end, and their sequences."""
        embeds = self._soft_embeds(out, soft_prompts) if soft_prompts else None
        if embeds is None and self.use_cuda_graphs:
            replayed = self._replay_decode(out, lora_slots, host_loras)
            if replayed is not None:
                self.steps_replayed += 1
                return replayed
        self.steps_eager += 1
        tokens, meta, sampling = self._prepare(out)
        lora = None
        if lora_slots and self.lora_device is not None:
            row_slots: list[int] = []
            one_token: list[bool] = []
            host: dict[str, tuple[LoRAWeights, list[int]]] = {
                n: (w, []) for n, w in (host_loras or {}).items()
            }
            row = 0
            for c in out.chunks:
                name = c.seq.lora
                slot = -1
                if name is not None and name in host:
                    host[name][1].extend(range(row, row + c.num_tokens))
                elif name is not None:
                    slot = lora_slots[name]
                row_slots += [slot] * c.num_tokens
                one_token += [c.num_tokens == 1] * c.num_tokens
                row += c.num_tokens
            lora = LoRABatch.build(
                self.lora_device,
                self.lora_kernel,
                row_slots,
                one_token,
                list(host.values()),
                self.lora_cpu_pool,
                self.lora_backend,
            )
        return self.model(tokens, meta, self.kv_caches, lora, embeds), sampling

    # -- CUDA graphs -------------------------------------------------------------------------------
    def _replay_decode(
        self,
        out: SchedulerOutput,
        lora_slots: dict[str, int] | None,
        host_loras: dict[str, LoRAWeights] | None,
    ) -> tuple[torch.Tensor, list] | None:
        """The step from a captured graph, or None when it is not a decode step a graph can replay: a
        chunk of more than one token, more decodes than the largest graph, an adapter whose delta is
        computed on the CPU (or the unpadded kernel with the torch backend: GraphLoRA replays the padded
        one only), no graphs."""
        chunks = out.chunks
        if not chunks or len(chunks) > self.cuda_graph_max_batch or any(c.num_tokens != 1 for c in chunks):
            return None
        uses_lora = any(c.seq.lora is not None for c in chunks)
        if uses_lora and (
            (self._graph_lora_segments() is None and self.lora_kernel != "padded")
            or any(c.seq.lora in (host_loras or {}) for c in chunks)
        ):
            return None
        graphs = self._decode_graphs()
        if graphs is None or (uses_lora and graphs.lora is None):
            return None
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        row_loras: list[int] = []
        sample_rows: list[int] = []
        sampling = []
        for row, c in enumerate(chunks):
            seq, start = c.seq, c.start
            prompt_len = len(seq.prompt_token_ids)
            ids = seq.prompt_token_ids if start < prompt_len else seq.output_token_ids
            tokens.append(ids[start if start < prompt_len else start - prompt_len])
            positions.append(start)
            slots.append(seq.block_table[start // bs] * bs + start % bs)
            lens.append(start + 1)
            tables.append(seq.block_table[: start // bs + 1])
            row_loras.append(lora_slots[seq.lora] if seq.lora is not None and lora_slots else -1)
            if c.samples:
                sample_rows.append(row)
                sampling.append(seq)
        step = graphs.pad(tokens, positions, slots, lens, tables, row_loras)
        if step is None:
            return None
        logits = graphs.replay(step, len(chunks))
        if len(sample_rows) != len(chunks):
            logits = logits[torch.tensor(sample_rows, device=self.device)]
        return logits, sampling

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Captured once, at the first decode step; None (and eager from then on) if that failed."""
        if self.graphs is None and self.use_cuda_graphs:
            graphs = self.graph_factory(
                self.cuda_graph_max_batch,
                -(-self.max_model_len // self.block_size),
                self.block_size,
                self.scratch_slot,
                self.device,
                self.lora_device if self.lora_kernel == "padded" or self._graph_lora_segments() else None,
                self._graph_lora_segments(),
            )
            if graphs.capture(self._graph_forward):
                self.graphs = graphs
                log.info("CUDA graphs captured for decode batches %s", graphs.ladder)
            else:
                self.use_cuda_graphs = False
        return self.graphs

    def _graph_lora_segments(self) -> LoraKernelName | None:
        """The kernel whose ranks graphs replay through the Triton LoRA kernels (None: GraphLoRA's torch
        ops, which replay the padded kernel only)."""
        return self.lora_kernel if self.lora_backend == "triton" and self.lora_device is not None else None

    def _graph_forward(
        self, tokens: torch.Tensor, meta: AttentionMetadata, lora: LoRABatch | None
    ) -> torch.Tensor:
        return self.model(tokens, meta, self.kv_caches, lora, None)

    def compile_or_fall_back(self) -> None:
        """compile_kernels, and on any failure the gather backend (logged): the Triton kernel passed
        its start-up check at small shapes, not necessarily at this model's (shared memory, a head size
        an unseen Triton compiles wrongly): serving goes on without it rather than failing."""
        try:
            self.compile_kernels()
        except Exception as exc:
            log.warning("attention backend gather: the triton kernel failed at this model's shapes "
                        "(%s: %s)", type(exc).__name__, exc)  # fmt: skip
            self.attention_backend = "gather"

    def compile_lora_or_fall_back(self) -> None:
        """The Triton LoRA kernels compiled at this model's targets (compile_kernels with a LoRA batch),
        and on any failure the torch path (logged). Through a forward, so the variants are those of
        serving: its outputs are column slices of the fused projections, with their strides."""
        if self.attention_backend != "triton" or self.lora_device is None:
            log.info("Triton LoRA kernels compile at the first eager LoRA step (attention is gather)")
            return
        # Rank 0: every load is masked, nothing is read or added (slot 0 holds no adapter yet).
        lora = LoRABatch(self.lora_device, self.lora_kernel, max_rank=1)
        rows = 1 + PREFIX_TILE_TOKENS
        lora.tiles = sgmv.build_tiles([(0, list(range(rows)), 0)], self.lora_device.max_rank, self.device)
        try:
            self.compile_kernels(lora)
        except Exception as exc:
            log.warning("LoRA deltas in torch: the Triton LoRA kernels failed at this model's shapes "
                        "(%s: %s)", type(exc).__name__, exc)  # fmt: skip
            self.lora_backend = "torch"

    @torch.inference_mode()
    def compile_kernels(self, lora: LoRABatch | None = None) -> None:
        """One forward through every Triton kernel variant serving launches, before the first request:
        a decode at each count of context splits a decode batch can take, and a prefill chunk over a
        cached prefix, at this model's heads, dtype and memory layout. Triton compiles a variant at its
        first launch, and a compile inside serving stalls every running request for as long as it
        takes (the likeliest cause, not yet confirmed on a GPU, of the first H200 runs' LoRA steps of
        ~100 ms against 7-11 ms without adapters, in traces of two seconds). The step writes K/V to
        the cache's first blocks: no sequence owns them yet, and a sequence writes a slot before it
        reads it. ``lora``: a batch over the step's rows, for the LoRA kernels (sgmv.py)."""
        bs, dev, n = self.block_size, self.device, PREFIX_TILE_TOKENS
        blocks = -(-(bs + n) // bs)  # a one-block prefix, then the chunk
        if self.num_kv_blocks < blocks:
            return
        table = list(range(blocks))  # block i holds positions i x bs ...: a slot is its position
        decode = triton_attention.build_tiles([(0, 1, bs + 1, table)], blocks, 1, dev)
        # A decode batch's context splits depend on its size: every count a batch can take.
        n_kv = self.model.n_kv_heads
        splits = {triton_attention.decode_splits(b * n_kv, dev) for b in range(1, self.max_num_seqs + 1)}
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([bs, *range(bs, bs + n)], device=dev),
            positions=torch.tensor([bs, *range(bs, bs + n)], device=dev),
            logits_index=torch.tensor([0, n], device=dev),
            paged=[
                *(dataclasses.replace(decode, splits=s) for s in sorted(splits)),
                triton_attention.build_tiles([(1, n, bs + n, table)], blocks, PREFIX_TILE_TOKENS, dev),
            ],
            page_size=bs,
        )
        self.model(torch.zeros(1 + n, dtype=torch.long, device=dev), meta, self.kv_caches, lora, None)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # -- KV cache ----------------------------------------------------------------------------------
    def kv_block_bytes(self) -> int:
        """Bytes of one block of K and V over all layers."""
        m = self.model
        per_token = 2 * m.num_layers * m.n_kv_heads * m.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _alloc_kv(self, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n_kv, hd, slots = self.model.n_kv_heads, self.model.head_dim, blocks * self.block_size
        # Head-major [KV heads, slots, head_dim]: a gathered context is contiguous (attention.py).
        return [
            (
                torch.zeros(n_kv, slots, hd, dtype=self.dtype, device=self.device),
                torch.zeros(n_kv, slots, hd, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.model.num_layers)
        ]

    def _fit_context(self, config: EngineConfig) -> None:
        """A context must fit the KV cache, or the scheduler refuses every request (a pod that is ready
        and serves nothing). The model's own length (Llama 3.1: 131,072 tokens) is capped at what the
        cache holds, logged; a max_model_len asked for that does not fit fails start-up, naming both."""
        fits = self.num_kv_blocks * self.block_size
        if self.max_model_len <= fits:
            return
        if config.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit the KV cache of {fits} tokens "
                f"({self.num_kv_blocks} blocks): lower max_model_len, or raise kv_cache_tokens "
                "(CPU) or kv_cache_memory_fraction (GPU)"
            )
        log.warning(
            "context capped at %d tokens, what the KV cache holds (the model's is %d); set "
            "kv_cache_tokens or kv_cache_memory_fraction for more",
            fits,
            self.max_model_len,
        )
        self.max_model_len = fits

    def _kv_blocks(self, config: EngineConfig) -> int:
        """The size given, the CPU default, or (CUDA) what the device's free memory holds."""
        if config.kv_size_given() or self.device.type != "cuda":
            return config.kv_blocks()
        activation = self._warmup_activation_bytes(config)
        free, _total = torch.cuda.mem_get_info(self.device)
        useful = config.max_num_seqs * -(-self.max_model_len // self.block_size)
        blocks = kv_blocks_for_memory(
            free, activation, config.kv_cache_memory_fraction, self.kv_block_bytes(), useful
        )
        log.info(
            "KV cache: %d blocks (%d tokens, %.2f GiB) of %.2f GiB free after the weights "
            "(warm-up activations %.2f GiB)",
            blocks, blocks * self.block_size, blocks * self.kv_block_bytes() / 2**30, free / 2**30,
            activation / 2**30,
        )  # fmt: skip
        return blocks

    @torch.inference_mode()
    def _warmup_activation_bytes(self, config: EngineConfig) -> int:
        """Peak device memory of the largest step (a full token budget of prefill) above what was
        allocated before it: the headroom steps need beside the KV cache."""
        length = min(config.max_num_batched_tokens, self.max_model_len)
        seqs = max(1, min(config.max_num_batched_tokens // length, config.max_num_seqs))
        n = seqs * length
        self.kv_caches = self._alloc_kv(-(-n // self.block_size))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev),
            positions=torch.arange(length, device=dev).repeat(seqs),
            logits_index=torch.arange(min(n, config.max_num_seqs), device=dev),
            prefills=[(i * length, (i + 1) * length, None, None) for i in range(seqs)],
        )
        tokens = torch.zeros(n, dtype=torch.long, device=dev)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self.model(tokens, meta, self.kv_caches, None, None)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        self.kv_caches = []
        torch.cuda.empty_cache()
        return max(0, peak - before)

    def _soft_embeds(
        self, out: SchedulerOutput, soft_prompts: dict[str, SoftPrompt]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of the step's virtual tokens: chunk positions below a request's count."""
        rows: list[int] = []
        vectors: list[torch.Tensor] = []
        row = 0
        for c in out.chunks:
            seq = c.seq
            if seq.soft_prompt is not None and c.start < seq.num_virtual_tokens:
                end = min(c.start + c.num_tokens, seq.num_virtual_tokens)
                rows += range(row, row + end - c.start)
                vectors.append(soft_prompts[seq.soft_prompt].embeddings[c.start : end])
            row += c.num_tokens
        if not rows:
            return None
        return torch.tensor(rows, device=self.device), torch.cat(vectors)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, list]:
        bs, dev = self.block_size, self.device
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampling = []
        decodes: list[tuple[int, int, list[int]]] = []  # (row, context length, block table)
        prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        in_place = self.attention_backend == "triton"
        paged_decodes: list[tuple[int, int, int, list[int]]] = []  # (row, tokens, context, table)
        paged_prefixes: list[tuple[int, int, int, list[int]]] = []
        row = 0
        for c in out.chunks:
            seq, start, n = c.seq, c.start, c.num_tokens
            table = seq.block_table
            if n == 1:  # decodes (and one-token chunks): plain integer arithmetic, no tensors
                prompt_len = len(seq.prompt_token_ids)
                ids = seq.prompt_token_ids if start < prompt_len else seq.output_token_ids
                tokens.append(ids[start if start < prompt_len else start - prompt_len])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                if in_place:
                    paged_decodes.append((row, 1, start + 1, table))
                else:
                    decodes.append((row, start + 1, table))
            else:
                tokens += seq.all_token_ids[start : start + n]
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                if start == 0:
                    prefills.append((row, row + n, None, None))
                elif in_place:
                    paged_prefixes.append((row, n, start + n, table))
                else:
                    ctx = torch.arange(start + n)
                    ctx_slots = (torch.tensor(table)[ctx // bs] * bs + ctx % bs).to(dev)
                    pos = torch.arange(start, start + n)
                    mask = (ctx[None, :] <= pos[:, None]).view(1, 1, n, start + n).to(dev)
                    prefills.append((row, row + n, ctx_slots, mask))
            if c.samples:
                logits_rows.append(row + n - 1)
                sampling.append(seq)
            row += n
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            positions=torch.tensor(positions, device=dev),
            # long even when empty: a step whose chunks all stop mid-prompt samples nothing
            logits_index=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            prefills=prefills,
        )
        meta.decodes = [self._decode_group(g) for g in _length_groups(decodes)]
        for group, tile_tokens in ((paged_decodes, 1), (paged_prefixes, PREFIX_TILE_TOKENS)):
            if group:
                width = max(-(-ctx // bs) for _, _, ctx, _ in group)
                meta.paged.append(triton_attention.build_tiles(group, width, tile_tokens, dev))
        meta.page_size = bs
        return torch.tensor(tokens, device=dev), meta, sampling

    def _decode_group(self, decodes: list[tuple[int, int, list[int]]]) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        # Blocks in use, not the whole table: a sequence's table is allocated ahead of its context.
        width = max(-(-n // bs) for _, n, _ in decodes)
        tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for _, _, t in decodes])
        lens = torch.tensor([n for _, n, _ in decodes])
        ctx = torch.arange(width * bs)
        return DecodeGroup(
            index=torch.tensor([r for r, _, _ in decodes], device=dev),
            blocks=tables.to(dev),
            mask=(ctx[None, :] < lens[:, None]).view(len(decodes), 1, 1, -1).to(dev),
        )


def kv_blocks_for_memory(
    free_bytes: int, activation_bytes: int, fraction: float, block_bytes: int, useful_blocks: int
) -> int:
    """KV blocks for ``fraction`` of the free device memory less the steps' activation headroom, and
    no more than the running batch can ever use (``useful_blocks``: max sequences x max length)."""
    budget = int(free_bytes * fraction) - activation_bytes
    blocks = min(budget // block_bytes, useful_blocks)
    if blocks < 1:
        raise ValueError(
            f"no room for a KV cache: {free_bytes / 2**30:.2f} GiB free x {fraction} less "
            f"{activation_bytes / 2**30:.2f} GiB of activations holds no {block_bytes}-byte block "
            "(set num_kv_blocks or kv_cache_tokens, or free device memory)"
        )
    return int(blocks)


def pick_attention_backend(choice: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """gather, or triton: asked for (it must work: else a clear error), or auto (on CUDA when Triton
    imports and its kernel agrees with gather on a start-up check; gather otherwise)."""
    use_triton = choose_triton(
        "attention_backend", choice, device, partial(triton_problem, device, dtype), "gather"
    )
    return "triton" if use_triton else "gather"


def triton_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot serve here (None: it can). Checks it against gather + SDPA on a small
    mixed batch (decodes of different lengths, a prefill chunk over a cached prefix, grouped-query
    heads), so a Triton that compiles it differently on an unseen GPU falls back instead of serving
    wrong tokens."""
    if (unusable := triton_unusable(device)) is not None:
        return unusable
    try:
        got, expected = _triton_check_outputs(device, dtype)
    except Exception as exc:  # any failure of an unseen Triton or GPU: use gather
        return f"{type(exc).__name__}: {exc}"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    if not torch.allclose(got.float(), expected.float(), rtol=tol, atol=tol):
        err = (got.float() - expected.float()).abs().max().item()
        return f"its output differs from gather + SDPA (max abs error {err:.3g})"
    return None


def _triton_check_outputs(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    page, n_kv, n_heads, d = 16, 2, 8, 64
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(n_kv, 16 * page, d, generator=gen).to(device, dtype) for _ in range(2)]
    # Decodes with contexts of 1, 17 and 40 tokens; a 5-token chunk after a 20-token cached prefix.
    tables = [[3], [5, 1], [7, 2, 9], [4, 6]]
    work = [(0, 1, 1), (1, 1, 17), (2, 1, 40), (3, 5, 25)]  # (first row, tokens, context)
    rows = 8
    q = torch.randn(rows, n_heads, d, generator=gen).to(device, dtype)
    k = torch.randn(rows, n_kv, d, generator=gen).to(device, dtype)
    v = torch.randn(rows, n_kv, d, generator=gen).to(device, dtype)
    slots = [
        t[p // page] * page + p % page
        for (_, n, ctx), t in zip(work, tables, strict=True)
        for p in range(ctx - n, ctx)
    ]
    outs = []
    for backend in ("triton", "gather"):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            positions=torch.tensor([p for _, n, ctx in work for p in range(ctx - n, ctx)], device=device),
            logits_index=torch.arange(rows, device=device),
            page_size=page,
        )
        if backend == "triton":
            decodes = [(r, n, ctx, t) for (r, n, ctx), t in zip(work[:3], tables[:3], strict=True)]
            meta.paged = [
                triton_attention.build_tiles(decodes, 3, 1, device),
                triton_attention.build_tiles([(3, 5, 25, tables[3])], 2, 4, device),
            ]
        else:
            for r, _, ctx in work[:3]:
                width = -(-ctx // page) * page
                blocks = torch.tensor([tables[r]], device=device)
                mask = (torch.arange(width, device=device) < ctx).view(1, 1, 1, width)
                meta.decodes.append(DecodeGroup(torch.tensor([r], device=device), blocks, mask))
            ctx_pos = torch.arange(25)
            ctx_slots = torch.tensor(tables[3])[ctx_pos // page] * page + ctx_pos % page
            causal = (ctx_pos[None, :] <= torch.arange(20, 25)[:, None]).view(1, 1, 5, 25)
            meta.prefills.append((3, 8, ctx_slots.to(device), causal.to(device)))
        kc, vc = caches[0].clone(), caches[1].clone()
        outs.append(paged_attention(q, k, v, kc, vc, meta, d**-0.5))
    return outs[0], outs[1]


def _length_groups(decodes: list[tuple[int, int, list[int]]]) -> list[list[tuple[int, int, list[int]]]]:
    """Decodes sorted by context length, cut where padding would cost more than another kernel call:
    a group grows while its padded size stays within 1.5x its real size (or it is small)."""
    groups: list[list[tuple[int, int, list[int]]]] = []
    real = 0
    for d in sorted(decodes, key=lambda x: x[1]):
        if groups and (len(groups[-1]) < 8 or (len(groups[-1]) + 1) * d[1] <= 1.5 * (real + d[1])):
            groups[-1].append(d)
            real += d[1]
        else:
            groups.append([d])
            real = d[1]
    return groups
