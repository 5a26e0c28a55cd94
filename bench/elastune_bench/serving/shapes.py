"""The model that ``elastune bench lora`` and ``elastune bench coserve`` run on (``--shape``): the tiny
Llama (``tiny-llama``, the default: trained weights, its own tokenizer and adapters), or a random-weight
model of a named shape (modeling/random_init.py SHAPES: ``llama-3-8b`` for a GPU,
``llama-micro`` for a CPU smoke run), written once per run into a temporary directory.

A random-weight model has no tokenizer of its own. The benchmarks' text (ShareGPT prompts, the tuning
task's records, the LoRA trace's prompts) is tokenized with the tiny Llama's tokenizer, whose 2,048 ids
fit any shape's vocabulary (``llama-micro``'s 512 is raised to 2,048; Llama-3-8B's 128,256 is kept, so
the embedding and the LM head keep their real size): its files are copied into the model directory
(the trainer reads them there), and the engine is given token ids with ``NoTokenizer`` (outputs are
meaningless and never detokenized). LoRA adapters of a random shape are random too: ranks 8/16/32/64 on
q, k, v of every layer, fp16 in PEFT's format (rank 64 on Llama-3-8B: 75 MiB), so the host-to-device
copies have their real size.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY = "tiny-llama"
LORA_RANKS = (8, 16, 32, 64)


def shape_names() -> tuple[str, ...]:
    from elastune_worker.modeling.random_init import SHAPES

    return (TINY, *SHAPES)


@dataclass
class BenchModel:
    shape: str
    path: Path
    tokenizer: Any
    """The tiny Llama's tokenizer: what the benchmarks encode their text with."""
    random: bool
    workdir: Path | None = None
    """Where a random shape's files live (removed by ``close``)."""
    _tmp: Any = field(default=None, repr=False)

    def engine_tokenizer(self) -> Any:
        """The ``tokenizer`` argument of LLMEngine: None (the model's own) or NoTokenizer."""
        if not self.random:
            return None
        from elastune_worker.modeling.random_init import NoTokenizer

        return NoTokenizer()

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, as the engine would encode it for the tiny Llama."""
        return list(self.tokenizer(text)["input_ids"])

    def label(self) -> str:
        return "tiny Llama" if not self.random else f"random-weight {self.shape}"

    def lora_adapters(self) -> dict[int, Path]:
        """One adapter per rank in LORA_RANKS: the tiny Llama's trained ones, or random ones of the
        shape (written once, in ``workdir``)."""
        if not self.random:
            from elastune_demo import adapters as A

            return {rank: A.ensure_tiny_adapter(rank) for rank in LORA_RANKS}
        from elastune_worker.modeling.random_init import read_random_config, write_random_lora

        assert self.workdir is not None
        cfg = read_random_config(self.path)
        assert cfg is not None
        return {
            rank: write_random_lora(self.workdir / "adapters" / f"r{rank}", cfg, rank) for rank in LORA_RANKS
        }

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def bench_model(shape: str = TINY) -> BenchModel:
    """The model of ``shape`` (TINY or a name in random_init.SHAPES); ``close()`` it when done."""
    from transformers import AutoTokenizer

    from elastune_demo.build import TINY_LLAMA_SPEC, ensure_tiny_model
    from elastune_worker.modeling.random_init import SHAPES, write_random_model

    if shape != TINY and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(shape_names())})")
    tiny = ensure_tiny_model(spec=TINY_LLAMA_SPEC)
    tok = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    if shape == TINY:
        return BenchModel(TINY, Path(tiny), tok, random=False)
    tmp = tempfile.TemporaryDirectory(prefix=f"elastune-bench-{shape}-")
    work = Path(tmp.name)
    path = write_random_model(work / shape, shape, tokenizer_from=Path(tiny), grow_vocab=True)
    return BenchModel(shape, path, tok, random=True, workdir=work, _tmp=tmp)
