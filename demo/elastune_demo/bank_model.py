"""A bank-specific tiny GPT-2 that *follows* its instructions, so that initial prompts matter.

Why a variant: on the default tiny model (build.py) the initial prompt barely matters to prompt
tuning. Every partition of the suite has inputs of its own (vocabulary, format, ranges), so the input
alone tells the model which task it faces; the default corpus also holds 20 % bare ``input → target``
examples, which teach exactly that. Measured on the default model (16 eval samples, 80 tasks, median):
loss 1.56 with the task's own instruction as the initial soft prompt vs 1.73 with a sibling task's and
1.80 with another family's; and after 5 AdamW steps of prompt tuning every initialisation sits at the
same loss, so iterations-to-accuracy do not depend on the prompt at all.

The variant is pretrained with the same recipe and sizes (``tiny.build`` pieces: tokenizer, blocks,
schedule) on a corpus where every example carries an instruction: 85 % the partition's own, 15 % a
generic family one, no bare examples and no plain text. The model then learns to read the instruction
(a wrong one now costs: median 1.52 right / 1.93 sibling / 2.52 other family), which is the property
the Prompt Bank exploits. With a learning rate whose steps are small next to the embedding scale (see
elastune_bench.tuning.bank) a poor initial prompt then needs many more iterations to reach the target
than a good one, as in the paper's §2.2.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from elastune_demo import build as B
from elastune_demo import tasks as T
from elastune_worker.fsutil import swap_into_place
from elastune_worker.model_cache import build_lock, cache_root, torch_threads

__all__ = ["BANK_MODEL_NAME", "BANK_SPEC", "bank_model_dir", "corpus_documents", "ensure_bank_model"]

BANK_MODEL_NAME = "tiny-gpt2-bank-v1"
#: Sizes and schedule of the default tiny model; only the corpus differs.
BANK_SPEC = B.DEFAULT_SPEC
_SPECIFIC_SHARE = 0.85


def corpus_documents(spec: B.TinyModelSpec = BANK_SPEC) -> list[str]:
    """Every example with an instruction before it: the partition's own (85 %) or its family's."""
    rng = random.Random(f"elastune-bank/corpus/{spec.seed}")
    docs: list[str] = []
    for task_spec in T.list_tasks():
        specific = T.partition_instructions(task_spec)
        generic = T.family_instructions(task_spec.family)
        # Same example draws as the default corpus (same seed offset): held-out tuning data stays unseen.
        for ex in T.sample_examples(task_spec, spec.examples_per_task, B.CORPUS_SEED_OFFSET + spec.seed):
            pool = specific if rng.random() < _SPECIFIC_SHARE else generic
            docs.append(T.format_example(ex["input"], ex["target"], rng.choice(pool)))
    rng.shuffle(docs)
    return docs


def bank_model_dir(cache_dir: Path | None = None, spec: B.TinyModelSpec = BANK_SPEC) -> Path:
    suffix = "" if spec == BANK_SPEC else "-" + spec.dirname().rsplit("-", 1)[-1]
    return cache_root(cache_dir) / "models" / (BANK_MODEL_NAME + suffix)


def _is_complete(path: Path, spec: B.TinyModelSpec) -> bool:
    info = B.read_build_info(path)
    return (
        info is not None
        and info.get("name") == BANK_MODEL_NAME
        and info.get("format_version") == B.FORMAT_VERSION
        and info.get("spec") == spec.fingerprint()
    )


def _train(out: Path, spec: B.TinyModelSpec, log: bool) -> dict[str, Any]:
    """tiny.build's one pretraining recipe on this module's corpus."""
    t0 = time.perf_counter()
    run = B.pretrain(corpus_documents(spec), spec, log=log, label="bank model ")
    run.model.save_pretrained(out, safe_serialization=True)
    run.tokenizer.save_pretrained(out)
    tail = run.losses[-20:]
    return {
        "name": BANK_MODEL_NAME,
        "format_version": B.FORMAT_VERSION,
        "spec": spec.fingerprint(),
        "corpus": {"documents": run.documents, "specific_share": _SPECIFIC_SHARE, "bare_examples": 0},
        "n_params": sum(p.numel() for p in run.model.parameters()),
        "final_loss": sum(tail) / len(tail),
        "heldout_loss": run.heldout_loss,
        "seconds": round(time.perf_counter() - t0, 2),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def ensure_bank_model(
    cache_dir: Path | None = None,
    *,
    spec: B.TinyModelSpec = BANK_SPEC,
    force: bool = False,
    log: bool = False,
) -> Path:
    """The instruction-following tiny model's directory, built first if missing (~3–5 min on 2 cores)."""
    out = bank_model_dir(cache_dir, spec).resolve()
    if not force and _is_complete(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        if not force and _is_complete(out, spec):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            with torch_threads(2):
                info = _train(tmp, spec, log)
            (tmp / B.INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
            for f in tmp.iterdir():
                f.chmod(0o644)
            tmp.chmod(0o755)
            swap_into_place(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
