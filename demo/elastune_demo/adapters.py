"""LoRA adapters of ranks 8, 16, 32 and 64 for the tiny Llama, trained by the project on different task
families so each one measurably changes outputs; built offline and cached like the models.

Each adapter is a PEFT ``save_pretrained`` directory (``adapter_config.json`` +
``adapter_model.safetensors``) at ``<cache root>/adapters/<name>``, next to a ``build_info.json`` that
records what the training bought: exact-match accuracy of greedy answers on held-out examples of its
family, with and without the adapter. Targets: every linear layer of the decoder (q, k, v, o, gate, up,
down), as multi-LoRA serving papers evaluate.

The rank-8 adapter is the quickstart's demo (``tiny-llama-units``) and is trained to be right, not only
different: the tiny Llama (0.8M parameters) cannot multiply three-digit numbers by 7, 12, 24 or 60, so
it learns the units partitions whose factor is a power of ten (km → m, m → cm, kg → g, l → ml: append
zeros) from 800 examples each, with a warm-up and cosine decay (held-out exact match 0 → ~0.9). The other
three keep their first recipe (every partition, 96 examples each, a constant rate): they change answers
measurably (lower answer loss) but rarely make them exact.

    python -m elastune_demo.adapters            # build the four (≈ 2 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from elastune_demo import tasks as T
from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model
from elastune_worker.model_cache import build_atomically, cache_root

INFO_FILE = "build_info.json"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    family: str
    """The task family it learns (bare ``input → target`` without an instruction)."""
    steps: int = 300
    batch_size: int = 16
    lr: float = 5e-4
    alpha_per_rank: float = 2.0
    """lora_alpha = alpha_per_rank × rank (scaling 2, as common practice)."""
    seed: int = 0
    version: int = 1
    partitions: tuple[int, ...] = ()
    """The family's partitions it learns and is measured on; empty: every partition."""
    train_per_partition: int = 96
    held_out_per_partition: int = 4
    warmup_steps: int = 0
    """With ``cosine``: linear warm-up over these steps, then cosine decay to 10 % of ``lr``."""
    schedule: Literal["constant", "cosine"] = "constant"

    @property
    def name(self) -> str:
        return f"{self.rank_name}-v{self.version}"

    @property
    def rank_name(self) -> str:
        """The name without its version (``--link-into`` links, the manifests' artifactURL)."""
        return f"tiny-llama-lora-r{self.rank}-{self.family}"

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the artifact (build_info.json "spec"). Fields added after version 1 appear
        only when they differ from their defaults, so the first adapters' caches stay valid."""
        d = asdict(self)
        for f in fields(self):
            if f.name in _LATER_FIELDS and d[f.name] == f.default:
                del d[f.name]
        return json.loads(json.dumps(d))  # tuples as lists, as build_info.json reads back

    def lr_at(self, step: int) -> float:
        if self.schedule == "constant":
            return self.lr
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


_LATER_FIELDS = ("partitions", "train_per_partition", "held_out_per_partition", "warmup_steps", "schedule")

ADAPTER_SPECS: dict[int, AdapterSpec] = {
    8: AdapterSpec(
        8,
        "units",
        steps=1000,
        lr=5e-3,
        version=2,
        partitions=(0, 1, 2, 5),  # km → m, m → cm, kg → g, l → ml
        train_per_partition=800,
        held_out_per_partition=16,
        warmup_steps=20,
        schedule="cosine",
    ),
    16: AdapterSpec(16, "case"),
    32: AdapterSpec(32, "dates"),
    64: AdapterSpec(64, "extract"),
}
"""One adapter per rank, each on its own family."""


def adapter_dir(spec: AdapterSpec, cache_dir: Path | None = None) -> Path:
    return cache_root(cache_dir) / "adapters" / spec.name


def is_complete(path: Path, spec: AdapterSpec) -> bool:
    info = path / INFO_FILE
    if not (info.is_file() and (path / "adapter_config.json").is_file()):
        return False
    return bool(json.loads(info.read_text()).get("spec") == spec.fingerprint())


def ensure_tiny_adapter(rank: int, cache_dir: Path | None = None) -> Path:
    """The adapter of ``rank`` (8, 16, 32 or 64), built first if missing."""
    if rank not in ADAPTER_SPECS:
        raise ValueError(f"no tiny adapter of rank {rank}; ranks: {sorted(ADAPTER_SPECS)}")
    return build_adapter(ADAPTER_SPECS[rank], cache_dir)


def build_adapter(spec: AdapterSpec, cache_dir: Path | None = None, *, log: bool = False) -> Path:
    return build_atomically(
        adapter_dir(spec, cache_dir),
        lambda d: is_complete(d, spec),
        lambda tmp: _train(spec, tmp, cache_dir, log=log),
    )


def _tasks(spec: AdapterSpec) -> list[T.Task]:
    return [
        T.make_task(task, spec.train_per_partition, spec.held_out_per_partition, seed=spec.seed)
        for task in T.list_tasks([spec.family])
        if not spec.partitions or task.partition in spec.partitions
    ]


def held_out_examples(spec: AdapterSpec) -> list[T.Example]:
    """The examples the adapter is measured on (never trained on): its build_info.json figures, and the
    quickstart's before/after through the gateway."""
    return [e for t in _tasks(spec) for e in t.eval]


def _examples(spec: AdapterSpec) -> tuple[list[tuple[str, str]], list[T.Example]]:
    """(prompt, answer) pairs over the adapter's partitions, and held-out examples."""
    train: list[tuple[str, str]] = []
    held: list[T.Example] = []
    for t in _tasks(spec):
        train += [(T.format_example(e["input"]), " " + e["target"]) for e in t.train]
        held += t.eval
    random.Random(spec.seed).shuffle(train)
    return train, held


def _train(spec: AdapterSpec, out: Path, cache_dir: Path | None, *, log: bool) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = ensure_tiny_model(cache_dir, spec=TINY_LLAMA_SPEC)
    tok = AutoTokenizer.from_pretrained(base_path, local_files_only=True)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True)
    train, held = _examples(spec)
    before = exact_match(model, tok, held)
    loss_before = answer_loss(model, tok, held)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=int(spec.alpha_per_rank * spec.rank),
        target_modules=list(TARGET_MODULES),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=spec.lr)
    eos = tok.eos_token_id
    started = time.perf_counter()
    peft_model.train()
    for step in range(spec.steps):
        batch = [train[(step * spec.batch_size + i) % len(train)] for i in range(spec.batch_size)]
        # The loss covers the answer (and its end) only: the prompt is the user's, not to be learnt.
        pairs = [_pair_ids(tok, q, a) for q, a in batch]
        width = max(len(q) + len(a) for q, a in pairs)
        inputs = torch.tensor([q + a + [eos] * (width - len(q) - len(a)) for q, a in pairs])
        labels = torch.tensor([[-100] * len(q) + a + [-100] * (width - len(q) - len(a)) for q, a in pairs])
        for group in opt.param_groups:
            group["lr"] = spec.lr_at(step)
        loss = peft_model(input_ids=inputs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log and (step % 50 == 0 or step == spec.steps - 1):
            print(f"  {spec.name} step {step:4d}  loss {loss.item():.3f}", flush=True)
    peft_model.eval()
    after = exact_match(peft_model, tok, held)
    loss_after = answer_loss(peft_model, tok, held)
    peft_model.save_pretrained(out)
    return {
        "spec": spec.fingerprint(),
        "base_model": TINY_LLAMA_SPEC.name,
        "train_examples": len(train),
        "held_out_examples": len(held),
        "exact_match_base": before,
        "exact_match_adapter": after,
        "answer_loss_base": loss_before,
        "answer_loss_adapter": loss_after,
        "train_seconds": round(time.perf_counter() - started, 1),
    }


def _pair_ids(tok: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    return tok(prompt)["input_ids"], tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def answer_loss(model: Any, tok: Any, examples: list[T.Example]) -> float:
    """Mean negative log-likelihood per answer token (the answer and its end) on ``examples``."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            q, a = _pair_ids(tok, T.format_example(e["input"]), " " + e["target"])
            logits = model(input_ids=torch.tensor([q + a])).logits[0]
            logp = torch.log_softmax(logits[len(q) - 1 : -1].float(), dim=-1)
            total -= float(logp[torch.arange(len(a)), torch.tensor(a)].sum())
            count += len(a)
    return round(total / max(1, count), 4)


def exact_match(model: Any, tok: Any, examples: list[T.Example], max_new_tokens: int = 24) -> float:
    """Share of examples whose greedy answer (up to the end of its line) equals the target."""
    import torch

    hits = 0
    with torch.no_grad():
        for e in examples:
            prompt = tok(T.format_example(e["input"]), return_tensors="pt")
            out = model.generate(
                **prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id
            )
            text = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            hits += text.strip().split("\n")[0].strip() == e["target"]
    return round(hits / max(1, len(examples)), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_demo.adapters", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, action="append", choices=sorted(ADAPTER_SPECS), help="default: all")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument(
        "--link-into", type=Path, metavar="DIR",
        help="also link each adapter as DIR/<name without the version> (manifests name them that way)",
    )  # fmt: skip
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for rank in args.rank or sorted(ADAPTER_SPECS):
        spec = ADAPTER_SPECS[rank]
        path = build_adapter(spec, args.cache_dir, log=True)
        info = json.loads((path / INFO_FILE).read_text())
        print(
            f"{spec.name}: held-out {spec.family}: answer loss {info['answer_loss_base']:.3f} -> "
            f"{info['answer_loss_adapter']:.3f}, exact match {info['exact_match_base']:.2f} -> "
            f"{info['exact_match_adapter']:.2f} ({path})"
        )
        if args.link_into is not None:
            args.link_into.mkdir(parents=True, exist_ok=True)
            link = args.link_into / spec.rank_name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(path, target_is_directory=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
