"""The small model and task the worker and operator tests share (one cached build for all of them).

A 2-layer, 64-wide variant of the tiny GPT-2: weakly pretrained (enough for prompts to matter), built
cold in seconds on two idle cores (the default model takes minutes) and cached under its own digest.
Import it after ``pytest.importorskip("torch")``: building the model needs torch.
"""

from __future__ import annotations

import dataclasses

from elastune_demo import build as tiny_build
from elastune_demo import tasks as tiny_tasks

TEST_SPEC = dataclasses.replace(
    tiny_build.DEFAULT_SPEC,
    vocab_size=768,
    n_layer=2,
    n_embd=64,
    n_head=2,
    n_positions=128,
    examples_per_task=40,
    block_size=64,
    batch_size=16,
    steps=250,
    warmup_steps=20,
)
TASK = tiny_tasks.TaskSpec("classify", 0)
