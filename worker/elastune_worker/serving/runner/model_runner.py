"""Runs the model for one scheduled step: builds the flat batch and the attention metadata from the
scheduler's chunks, runs one forward over the paged KV cache, samples the next tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from elastune_worker.serving.config import EngineConfig, LoraKernelName
from elastune_worker.serving.core.scheduler import SchedulerOutput
from elastune_worker.serving.runner.attention import AttentionMetadata, DecodeGroup
from elastune_worker.serving.runner.lora.cpu_workers import CpuLoRAPool
from elastune_worker.serving.runner.lora.kernels import LoRABatch
from elastune_worker.serving.runner.lora.slots import DeviceLoRAs
from elastune_worker.serving.runner.lora.weights import LoRAWeights
from elastune_worker.serving.runner.models.loader import context_length, load_model
from elastune_worker.serving.runner.sampler import Sampler
from elastune_worker.serving.runner.soft_prompts import SoftPrompt


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
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.hidden_size = int(self.hf_config.get("hidden_size") or self.hf_config["n_embd"])
        slots = config.kv_blocks() * config.block_size
        n_kv, hd, n_layers = self.model.n_kv_heads, self.model.head_dim, self.model.num_layers
        # Head-major [KV heads, slots, head_dim]: a gathered context is contiguous (attention.py).
        self.kv_caches = [
            (
                torch.zeros(n_kv, slots, hd, dtype=self.dtype, device=self.device),
                torch.zeros(n_kv, slots, hd, dtype=self.dtype, device=self.device),
            )
            for _ in range(n_layers)
        ]
        self.sampler = Sampler(self.device)
        self.lora_device: DeviceLoRAs | None = None  # set by the engine's LoRAManager
        self.lora_kernel: LoraKernelName = config.lora_kernel
        self.lora_cpu_pool: CpuLoRAPool | None = None  # set by the engine when it has CPU LoRA workers

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
        tokens, meta, sampling = self._prepare(out)
        embeds = self._soft_embeds(out, soft_prompts) if soft_prompts else None
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
            )
        return self.model(tokens, meta, self.kv_caches, lora, embeds), sampling

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
                decodes.append((row, start + 1, table))
            else:
                tokens += seq.all_token_ids[start : start + n]
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                if start == 0:
                    prefills.append((row, row + n, None, None))
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
            logits_index=torch.tensor(logits_rows, device=dev),
            prefills=prefills,
        )
        meta.decodes = [self._decode_group(g) for g in _length_groups(decodes)]
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
