"""Build a tiny GPT-2 base model offline, from Elastune's own task corpus (docs/design.md §6 "Tiny models").

Nothing is downloaded: a byte-level BPE tokenizer is trained with `tokenizers` on the task suite of
`tasks.py`, a small GPT-2 is initialised from a config and pretrained briefly on the same corpus, and the
result is saved as a directory that `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load with `HF_HUB_OFFLINE=1`.

Why pretrain at all: prompt tuning on a random-init base barely moves the loss, and prompt sensitivity
(what the Prompt Bank exploits) only appears once the base has learned that an instruction before the
input selects the transformation. The corpus therefore mixes partition-specific instructions, generic
family instructions and bare examples, so that a (soft) prompt has something to select.

    python -m elastune_demo.build [--force] [--out DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from elastune_worker.model_cache import build_atomically, cache_root

from . import tasks as T

MODEL_NAME = "tiny-gpt2-v1"
# Bump when the corpus, tokenizer or training recipe changes, so stale caches are rebuilt.
FORMAT_VERSION = 2
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
INFO_FILE = "build_info.json"
#: A minimal chat template (Jinja, as transformers renders it) for the tiny Llama: role-tagged turns,
#: then the assistant's tag so generation continues as the assistant.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
#: Pretraining examples are drawn with seeds far from the small seeds tests and benchmarks use for
#: make_task, so tuning data is not replayed verbatim (pools of a few partitions still overlap).
CORPUS_SEED_OFFSET = 1_000_003
#: Fields that only the Llama architecture reads: left out of a GPT-2 spec's fingerprint, so adding them
#: kept every GPT-2 cache (and its directory name) valid.
_LLAMA_FIELDS = ("architecture", "n_kv_head", "intermediate_size", "rope_theta")


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the artifact; part of its cache key and of build_info.json."""

    vocab_size: int = 2048
    n_layer: int = 3
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 256
    # No dropout: a few hundred steps on a tiny model underfit rather than overfit, and a dropout-free
    # base makes later prompt-tuning losses deterministic given a seed.
    dropout: float = 0.0
    examples_per_task: int = 300
    block_size: int = 128
    batch_size: int = 16
    steps: int = 700
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    architecture: Literal["gpt2", "llama"] = "gpt2"
    n_kv_head: int = 0
    """Llama: key/value heads (grouped-query attention when fewer than n_head)."""
    intermediate_size: int = 0
    """Llama: width of the SwiGLU MLP."""
    rope_theta: float = 10000.0
    """Llama: RoPE base."""
    name: str = MODEL_NAME
    """The cache directory of this spec's family (variants get a digest suffix)."""

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the artifact (build_info.json "spec", the digest of ``dirname``)."""
        d = dataclasses.asdict(self)
        del d["name"]
        if self.architecture == "gpt2":
            for key in _LLAMA_FIELDS:
                del d[key]
        return d

    def dirname(self) -> str:
        """Each family's default spec owns its name; any variant gets a digest suffix so caches never mix."""
        if self in (DEFAULT_SPEC, TINY_LLAMA_SPEC):
            return self.name
        digest = hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode()).hexdigest()
        return f"{self.name}-{digest[:10]}"


DEFAULT_SPEC = TinyModelSpec()
#: A Llama-architecture tiny model for serving (RMSNorm, RoPE, SwiGLU, grouped-query attention) with a
#: 2,048-position context so prefix reuse matters; same tokenizer recipe and corpus as the GPT-2. It is
#: pretrained on 256-token blocks: positions past that work (RoPE) but were not trained on.
TINY_LLAMA_SPEC = TinyModelSpec(
    architecture="llama",
    name="tiny-llama-v1",
    n_positions=2048,
    n_embd=128,
    n_layer=3,
    n_head=4,
    n_kv_head=2,
    intermediate_size=352,
    block_size=256,
    batch_size=8,
)


# --------------------------------------------------------------------------------------- locations
def model_dir(cache_dir: Path | None = None, spec: TinyModelSpec = DEFAULT_SPEC) -> Path:
    """Where the artifact for `spec` lives: `<cache root>/models/tiny-gpt2-v1[-digest]`."""
    return cache_root(cache_dir) / "models" / spec.dirname()


def read_build_info(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(path) / INFO_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path, spec: TinyModelSpec = DEFAULT_SPEC) -> bool:
    """build_info.json is written last, inside the temp dir, so its presence means a whole artifact."""
    info = read_build_info(path)
    return (
        info is not None
        and info.get("format_version") == FORMAT_VERSION
        and info.get("spec") == spec.fingerprint()
    )


# ------------------------------------------------------------------------------------------ corpus
def corpus_documents(spec: TinyModelSpec = DEFAULT_SPEC) -> list[str]:
    """The pretraining documents, deterministic in `spec.seed`, mixing all families and partitions.

    Per example: 50 % with the partition's own instruction, 15 % with a generic family instruction,
    20 % bare `input → target`, 15 % plain text (the input or the target alone). Instructions dominate so
    the model learns to read the text before the input, which is what makes prompts matter.
    """
    rng = random.Random(f"elastune-tiny/corpus/{spec.seed}")
    docs: list[str] = []
    for task_spec in T.list_tasks():
        specific = T.partition_instructions(task_spec)
        generic = T.family_instructions(task_spec.family)
        examples = T.sample_examples(task_spec, spec.examples_per_task, CORPUS_SEED_OFFSET + spec.seed)
        for ex in examples:
            x, y = ex["input"], ex["target"]
            r = rng.random()
            if r < 0.50:
                docs.append(T.format_example(x, y, rng.choice(specific)))
            elif r < 0.65:
                docs.append(T.format_example(x, y, rng.choice(generic)))
            elif r < 0.85:
                docs.append(T.format_example(x, y))
            else:
                docs.append(x if rng.random() < 0.5 else y)
    rng.shuffle(docs)
    return docs


def all_instructions() -> list[str]:
    out: list[str] = []
    for fam in T.FAMILIES:
        out += T.family_instructions(fam)
        for s in T.list_tasks([fam]):
            out += T.partition_instructions(s)
    return out


# --------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(docs: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 style, no prefix space) wrapped as a transformers GPT-2 tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        # All 256 byte symbols up front: any text stays encodable even if unseen in the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs + all_instructions(), trainer=trainer)
    return GPT2TokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        # A pad distinct from eos: tuners mask padding without also masking the end of a target.
        pad_token=PAD_TOKEN,
    )


def token_blocks(token_docs: list[list[int]], eos_id: int, block_size: int) -> Any:
    import torch

    stream: list[int] = []
    for ids in token_docs:
        stream += ids
        stream.append(eos_id)
    n = len(stream) // block_size
    return torch.tensor(stream[: n * block_size], dtype=torch.long).view(n, block_size)


# ----------------------------------------------------------------------------------------- training
def lr_at(step: int, spec: TinyModelSpec) -> float:
    """Linear warm-up, then cosine decay to 10 % of ``spec.lr``."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def model_config(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """The transformers config of ``spec``'s architecture (GPT-2, or Llama with RMSNorm, RoPE, SwiGLU,
    grouped-query attention)."""
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    if spec.architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=spec.n_embd,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.n_head,
            num_key_value_heads=spec.n_kv_head or spec.n_head,
            max_position_embeddings=spec.n_positions,
            rope_theta=spec.rope_theta,
            attention_dropout=spec.dropout,
            tie_word_embeddings=True,  # a tiny vocabulary: untied output weights would double the size
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=spec.dropout,
        embd_pdrop=spec.dropout,
        attn_pdrop=spec.dropout,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        loss_type="ForCausalLM",  # explicit, else transformers 5 warns on every loss computation
    )


@dataclass
class Pretrained:
    """What ``pretrain`` returns: the model, its tokenizer and the figures build_info.json records."""

    model: Any
    tokenizer: Any
    losses: list[float]
    heldout_loss: float
    documents: int
    train_blocks: int
    tokens: int
    seconds_data: float


def pretrain(docs: list[str], spec: TinyModelSpec, *, log: bool = False, label: str = "") -> Pretrained:
    """The one pretraining recipe of every tiny model: a byte-level BPE tokenizer on ``docs``, fixed-size
    blocks, AdamW with warm-up + cosine, a held-out slice of blocks for an honest final loss."""
    import torch
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(docs, spec.vocab_size)
    tokenizer.model_max_length = spec.n_positions
    blocks = token_blocks(tokenizer(docs)["input_ids"], tokenizer.eos_token_id, spec.block_size)
    n_heldout = max(1, min(16, len(blocks) // 20))
    train_blocks, heldout = blocks[n_heldout:], blocks[:n_heldout]
    t_data = time.perf_counter() - t0

    torch.manual_seed(spec.seed)
    model_class = LlamaForCausalLM if spec.architecture == "llama" else GPT2LMHeadModel
    model = model_class(model_config(spec, tokenizer))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.98),
    )
    gen = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(train_blocks), generator=gen)
    cursor, losses = 0, []
    model.train()
    for step in range(spec.steps):
        if cursor + spec.batch_size > len(order):  # next epoch, reshuffled deterministically
            order, cursor = torch.randperm(len(train_blocks), generator=gen), 0
        batch = train_blocks[order[cursor : cursor + spec.batch_size]]
        cursor += spec.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log and (step % 50 == 0 or step == spec.steps - 1):
            elapsed = time.perf_counter() - t0
            print(f"  {label}step {step:4d}/{spec.steps}  loss {losses[-1]:.3f}  {elapsed:6.1f}s", flush=True)
    model.eval()
    with torch.no_grad():
        heldout_loss = float(model(input_ids=heldout, labels=heldout).loss)
    return Pretrained(
        model, tokenizer, losses, heldout_loss, len(docs), len(train_blocks), int(blocks.numel()), t_data
    )


def _write_artifact(out: Path, spec: TinyModelSpec, *, log: bool) -> dict[str, Any]:
    """Train tokenizer and model, save both into `out` (an empty temp dir), return build info."""
    import tokenizers
    import torch
    import transformers

    t0 = time.perf_counter()
    run = pretrain(corpus_documents(spec), spec, log=log)
    model, tokenizer = run.model, run.tokenizer
    if spec.architecture == "llama":
        tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tail = run.losses[-20:] or [float("nan")]
    return {
        "name": spec.dirname(),
        "format_version": FORMAT_VERSION,
        "spec": spec.fingerprint(),
        "model_config": {
            k: v for k, v in model.config.to_diff_dict().items() if isinstance(v, int | float | str)
        },
        "n_params": sum(p.numel() for p in model.parameters()),
        "corpus": {
            "documents": run.documents,
            "train_blocks": run.train_blocks,
            "tokens": run.tokens,
            "tasks": len(T.list_tasks()),
        },
        "steps": spec.steps,
        "epochs": round(spec.steps * spec.batch_size / max(1, run.train_blocks), 2),
        "initial_loss": run.losses[0] if run.losses else None,
        "final_loss": sum(tail) / len(tail),
        "heldout_loss": run.heldout_loss,
        "seconds": round(time.perf_counter() - t0, 2),
        "seconds_data": round(run.seconds_data, 2),
        "torch_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def build_tiny_model(
    out_dir: Path, spec: TinyModelSpec = DEFAULT_SPEC, *, force: bool = False, log: bool = False
) -> Path:
    """Build `spec` into exactly `out_dir` unless a complete artifact for it is already there.

    The build happens in a sibling temp dir that is renamed into place only when complete, so a killed
    build never leaves a half model where loaders look.
    """
    return build_atomically(
        out_dir, lambda d: is_complete(d, spec), lambda tmp: _write_artifact(tmp, spec, log=log), force=force
    )


def ensure_tiny_model(
    cache_dir: Path | None = None, *, force: bool = False, spec: TinyModelSpec = DEFAULT_SPEC
) -> Path:
    """Return the tiny model's directory, building it first if missing (~2 min on 2 idle CPU cores).

    Cached at `<cache_dir | $ELASTUNE_CACHE | ~/.cache/elastune>/models/tiny-gpt2-v1` (or
    `tiny-llama-v1` for TINY_LLAMA_SPEC); a variant `spec` (e.g. fewer steps for tests) gets its own
    directory.
    """
    return build_tiny_model(model_dir(cache_dir, spec), spec, force=force)


def load_tiny_model(path: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a built directory, strictly from local files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_demo.build", description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="rebuild even if a complete artifact exists")
    p.add_argument("--out", type=Path, help="exact output directory (default: the cache location)")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $ELASTUNE_CACHE or ~/.cache/elastune)")
    p.add_argument(
        "--arch",
        choices=("gpt2", "llama"),
        default="gpt2",
        help="gpt2 (tiny-gpt2-v1) or llama (tiny-llama-v1)",
    )
    p.add_argument("--steps", type=int, help=f"pretraining steps (default {DEFAULT_SPEC.steps})")
    p.add_argument("--seed", type=int, help=f"seed (default {DEFAULT_SPEC.seed})")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-step log")
    args = p.parse_args(argv)
    # Must precede the first torch import (build.py imports torch lazily): with the default spinning
    # policy, 2 OpenMP threads on a 2-core machine shared with another torch process run ~25× slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    overrides = {k: v for k, v in (("steps", args.steps), ("seed", args.seed)) if v is not None}
    base = TINY_LLAMA_SPEC if args.arch == "llama" else DEFAULT_SPEC
    spec = dataclasses.replace(base, **overrides)
    target = args.out if args.out is not None else model_dir(args.cache_dir, spec)
    cached = not args.force and is_complete(target, spec)
    path = build_tiny_model(target, spec, force=args.force, log=not args.quiet)
    info = read_build_info(path) or {}
    verb = "cached at" if cached else "wrote"
    print(
        f"{verb} {path}: {info.get('n_params', 0) / 1e6:.2f}M params, {info.get('steps')} steps, "
        f"build {info.get('seconds')} s, final loss {info.get('final_loss', float('nan')):.3f}, "
        f"held-out loss {info.get('heldout_loss', float('nan')):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
