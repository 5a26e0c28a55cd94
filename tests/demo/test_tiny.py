"""The self-made task suite and the offline tiny GPT-2 (demo/elastune_demo).

The model tests build a reduced variant once per session into a temp cache (the default artifact takes
minutes on 2 cores); one test checks the default artifact too when it is already in the user's cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

# Before torch is first imported: spinning OpenMP threads on the 2-core machines, shared with another
# torch process, make steps ~25× slower (measured); sleeping waiters cost nothing here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from elastune_demo import build as B
from elastune_demo import tasks as T

# A reduced build: same tokenizer, corpus recipe and architecture; 2 layers, 150 steps of 16×64 tokens
# (~17 s on 2 busy cores). Weakly pretrained, so tuning gains are large and easy to assert.
TEST_SPEC = B.TinyModelSpec(n_layer=2, n_embd=128, examples_per_task=120, steps=150, lr=4e-3, block_size=64)
# Just enough to exercise the full build path (determinism, atomicity, caching) in a few seconds.
MICRO_SPEC = B.TinyModelSpec(n_layer=1, n_embd=32, n_head=2, examples_per_task=15, steps=3, vocab_size=512)


# ------------------------------------------------------------------------------------------- tasks
def test_suite_has_at_least_60_tasks_in_6_families_of_10_partitions():
    specs = T.list_tasks()
    per_family = Counter(s.family for s in specs)
    assert len(specs) >= 60
    assert len(per_family) >= 6
    assert min(per_family.values()) >= 10
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z]+-\d\d", n) for n in names)
    assert T.TaskSpec("sql", 3).name == "sql-03" == T.make_task(T.TaskSpec("sql", 3), 2, 1).name


def test_make_task_is_deterministic_for_a_seed_and_varies_with_it():
    changed = 0
    for spec in T.list_tasks():
        a, b = T.make_task(spec, 16, 8, seed=7), T.make_task(spec, 16, 8, seed=7)
        assert (a.train, a.eval) == (b.train, b.eval)
        changed += T.make_task(spec, 16, 8, seed=8).train != a.train
    assert changed == len(T.list_tasks())


def test_train_and_eval_are_disjoint_and_well_formed():
    for spec in T.list_tasks():
        task = T.make_task(spec, 128, 32, seed=0)
        assert len(task.train) == 128 and len(task.eval) == 32
        train_inputs = {e["input"] for e in task.train}
        eval_inputs = {e["input"] for e in task.eval}
        assert len(train_inputs) == 128 and len(eval_inputs) == 32
        assert not train_inputs & eval_inputs, spec.name
        for e in task.train + task.eval:
            assert set(e) == {"input", "target"} and e["input"].strip() and e["target"].strip()
            assert T.SEPARATOR not in e["input"] + e["target"]


def test_partitions_of_a_family_are_exclusive():
    for family in T.FAMILIES:
        owner: dict[str, int] = {}
        for spec in T.list_tasks([family]):
            for e in T.sample_examples(spec, 400, seed=1):
                assert owner.setdefault(e["input"], spec.partition) == spec.partition, (family, e["input"])


def test_partitions_are_different_tasks():
    for family in T.FAMILIES:
        specs = T.list_tasks([family])
        first = [tuple(T.partition_instructions(s)) for s in specs]
        assert len(set(first)) == len(specs), family
        if family in {"arith", "listops", "extract"}:
            continue  # numbers and names may legitimately coincide as answers there
        # Elsewhere each partition has its own output space (schema, casing, labels, unit, date format).
        targets = [{e["target"] for e in T.make_task(s, 64, 0).train} for s in specs]
        for i in range(len(targets)):
            for j in range(i + 1, len(targets)):
                assert not targets[i] & targets[j], (family, i, j)


def test_family_instructions_describe_each_family():
    seen: set[str] = set()
    for family in T.FAMILIES:
        instr = T.family_instructions(family)
        assert len(instr) >= 3 and all(i.strip() for i in instr)
        assert not seen & set(instr)
        seen |= set(instr)
    with pytest.raises(ValueError, match="unknown task family"):
        T.family_instructions("nope")
    with pytest.raises(ValueError):
        T.make_task(T.TaskSpec("sql", 10))


def test_asking_for_more_examples_than_a_partition_holds_fails_fast():
    with pytest.raises(ValueError, match="distinct inputs"):
        T.make_task(T.TaskSpec("classify", 8), n_train=100_000, n_eval=0)


def test_write_jsonl_round_trips(tmp_path):
    task = T.make_task(T.TaskSpec("dates", 4), 5, 3, seed=2)
    path = T.write_jsonl(task.train, tmp_path / "d" / "train.jsonl")
    assert T.read_jsonl(path) == task.train
    assert all(json.loads(line)["input"] for line in path.read_text().splitlines())


def test_format_example_is_the_shared_layout():
    assert T.format_example("5 km") == "5 km →"
    assert T.format_example("5 km", "5000 m", "Convert.") == "Convert.\n5 km → 5000 m"


# --------------------------------------------------------------------------------- build mechanics
def test_cache_location_follows_argument_env_and_spec(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTUNE_CACHE", str(tmp_path / "env"))
    assert B.model_dir() == tmp_path / "env" / "models" / "tiny-gpt2-v1"
    assert B.model_dir(tmp_path / "arg") == tmp_path / "arg" / "models" / "tiny-gpt2-v1"
    monkeypatch.delenv("ELASTUNE_CACHE")
    assert B.model_dir() == Path.home() / ".cache" / "elastune" / "models" / "tiny-gpt2-v1"
    variant = B.model_dir(tmp_path, TEST_SPEC).name
    assert variant.startswith("tiny-gpt2-v1-") and variant != B.model_dir(tmp_path, MICRO_SPEC).name


def test_build_is_deterministic(tmp_path):
    pytest.importorskip("transformers")
    a = B.build_tiny_model(tmp_path / "a", MICRO_SPEC)
    b = B.build_tiny_model(tmp_path / "b", MICRO_SPEC)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    other = B.build_tiny_model(tmp_path / "c", dataclasses.replace(MICRO_SPEC, seed=1))
    assert (a / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_killed_build_leaves_nothing_and_cache_is_reused(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    out = tmp_path / "models" / "m"
    real = B._write_artifact

    def dies_midway(path: Path, spec: B.TinyModelSpec, *, log: bool) -> dict[str, Any]:
        (path / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # like Ctrl-C / a kill during training

    monkeypatch.setattr(B, "_write_artifact", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        B.build_tiny_model(out, MICRO_SPEC)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []

    # A SIGKILLed build runs no cleanup: its temp dir stays until the next build of that artifact.
    leftover = out.parent / ".m.tmp-killed"
    (leftover / "model.safetensors").parent.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    calls: list[int] = []

    def counting(path: Path, spec: B.TinyModelSpec, *, log: bool) -> dict[str, Any]:
        calls.append(1)
        return real(path, spec, log=log)

    monkeypatch.setattr(B, "_write_artifact", counting)
    assert B.build_tiny_model(out, MICRO_SPEC) == out.resolve()
    assert not leftover.exists()
    B.build_tiny_model(out, MICRO_SPEC)
    assert len(calls) == 1  # second call served from cache
    info = json.loads((out / "build_info.json").read_text())
    info["format_version"] = -1  # a stale artifact from an older recipe must be rebuilt
    (out / "build_info.json").write_text(json.dumps(info))
    B.build_tiny_model(out, MICRO_SPEC)
    B.build_tiny_model(out, MICRO_SPEC, force=True)
    assert len(calls) == 3
    assert B.is_complete(out, MICRO_SPEC) and not B.is_complete(out, TEST_SPEC)


def test_cli_builds_then_reports_the_cache(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "cli-model"
    assert B.main(["--out", str(out), "--steps", "2", "-q"]) == 0
    first = capsys.readouterr().out
    assert f"wrote {out.resolve()}" in first and "final loss" in first
    assert B.main(["--out", str(out), "--steps", "2", "-q"]) == 0
    assert "cached at" in capsys.readouterr().out
    assert json.loads((out / "build_info.json").read_text())["steps"] == 2


# ------------------------------------------------------------------------------------ model + PEFT
@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return B.ensure_tiny_model(tmp_path_factory.mktemp("elastune-cache"), spec=TEST_SPEC)


def test_build_info_records_a_learning_run(tiny_model_dir):
    info = B.read_build_info(tiny_model_dir)
    assert info is not None and B.is_complete(tiny_model_dir, TEST_SPEC)
    assert info["steps"] == TEST_SPEC.steps and info["model_config"]["n_layer"] == 2
    assert info["corpus"]["tasks"] == len(T.list_tasks())
    # Pretraining must have learned the corpus, well below the uniform ln(vocab) ≈ 7.6.
    assert info["heldout_loss"] < 0.5 * info["initial_loss"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_model_dir / name).is_file()


_OFFLINE_SCRIPT = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path)
tok = AutoTokenizer.from_pretrained(path)
ids = tok("12 km →", return_tensors="pt")
out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
print(json.dumps({"vocab": len(tok), "eos": tok.eos_token_id, "pad": tok.pad_token_id,
                  "new": out.shape[1] - ids["input_ids"].shape[1], "cls": type(tok).__name__}))
"""


def test_loads_offline_in_a_fresh_process_and_generates(tiny_model_dir):
    # A fresh interpreter so HF_HUB_OFFLINE is honoured from import time; a dead proxy makes any
    # attempted network access fail instead of silently succeeding.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", NO_PROXY="")
    res = subprocess.run(
        [sys.executable, "-c", _OFFLINE_SCRIPT, str(tiny_model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["vocab"] <= TEST_SPEC.vocab_size and got["eos"] != got["pad"]
    assert got["new"] >= 1 and got["cls"].startswith("GPT2Tokenizer")


def _encode(tokenizer: Any, examples: list[dict[str, str]]) -> dict[str, Any]:
    """Right-padded batch; loss only on the target tokens (and the eos that ends them)."""
    import torch

    ids, labels = [], []
    for e in examples:
        prompt = tokenizer(T.format_example(e["input"]))["input_ids"]
        target = [*tokenizer(" " + e["target"])["input_ids"], tokenizer.eos_token_id]
        ids.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    n = max(map(len, ids))
    return {
        "input_ids": torch.tensor([x + [tokenizer.pad_token_id] * (n - len(x)) for x in ids]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in ids]),
        "labels": torch.tensor([x + [-100] * (n - len(x)) for x in labels]),
    }


def _prompt_tuned(model_dir: Path, init_text: str) -> Any:
    import torch
    from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    config = PromptTuningConfig(
        task_type=TaskType.CAUSAL_LM,
        prompt_tuning_init=PromptTuningInit.TEXT,
        prompt_tuning_init_text=init_text,
        num_virtual_tokens=8,
        tokenizer_name_or_path=str(model_dir),
    )
    return get_peft_model(base, config)


def _eval_loss(model: Any, batch: dict[str, Any]) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)


# peft calls a transformers API deprecated in v5; not ours to fix, and must not fail a -W error run.
_PEFT_DEPRECATION = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
TUNE_TASK = T.TaskSpec("classify", 0)  # label-word classification, the canonical prompt-tuning task


@_PEFT_DEPRECATION
def test_prompt_tuning_reduces_eval_loss(tiny_model_dir):
    pytest.importorskip("peft")
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    task = T.make_task(TUNE_TASK, n_train=64, n_eval=32, seed=0)
    eval_batch = _encode(tok, task.eval)
    model = _prompt_tuned(tiny_model_dir, T.family_instructions(TUNE_TASK.family)[0])
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == 8 * TEST_SPEC.n_embd  # only the soft prompt learns
    before = _eval_loss(model, eval_batch)
    opt = torch.optim.AdamW(trainable, lr=0.03)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(40):
        idx = torch.randint(0, len(task.train), (8,), generator=gen).tolist()
        model(**_encode(tok, [task.train[i] for i in idx])).loss.backward()
        opt.step()
        opt.zero_grad()
    after = _eval_loss(model, eval_batch)
    # Observed on TEST_SPEC: 1.981 -> 1.371 (-31 %); demand -20 %.
    assert after < 0.8 * before, (before, after)


@_PEFT_DEPRECATION
def test_text_initialisation_changes_the_loss_before_tuning(tiny_model_dir):
    """Prompt sensitivity: the property the Prompt Bank exploits must exist on this model."""
    pytest.importorskip("peft")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    eval_batch = _encode(tok, T.make_task(TUNE_TASK, n_train=0, n_eval=32, seed=0).eval)
    texts = T.family_instructions(TUNE_TASK.family)[:3]
    losses = [_eval_loss(_prompt_tuned(tiny_model_dir, t), eval_batch) for t in texts]
    # Observed on TEST_SPEC: 1.981 / 2.080 / 1.908 (spread 0.17).
    assert max(losses) - min(losses) > 0.05, losses


def test_default_artifact_loads_if_present():
    path = B.model_dir()
    if not B.is_complete(path):
        pytest.skip(f"no default tiny model at {path} (python -m elastune_demo.build)")
    model, tok = B.load_tiny_model(path)
    assert model.config.n_layer == B.DEFAULT_SPEC.n_layer and len(tok) <= B.DEFAULT_SPEC.vocab_size
    ids = tok(T.format_example("12 km"), return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]


# ------------------------------------------------------------------------------------ tiny Llama
LLAMA_MICRO = dataclasses.replace(
    B.TINY_LLAMA_SPEC, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64, n_layer=1,
    examples_per_task=15, steps=3, vocab_size=512, block_size=64, batch_size=4,
)  # fmt: skip


def test_gpt2_fingerprints_ignore_the_llama_fields():
    """Adding the architecture fields kept every GPT-2 cache valid: same name, same fingerprint keys."""
    assert B.DEFAULT_SPEC.dirname() == "tiny-gpt2-v1" and B.TINY_LLAMA_SPEC.dirname() == "tiny-llama-v1"
    assert "architecture" not in B.DEFAULT_SPEC.fingerprint() and "name" not in B.DEFAULT_SPEC.fingerprint()
    assert B.TINY_LLAMA_SPEC.fingerprint()["n_kv_head"] == 2
    assert B.model_dir(None, LLAMA_MICRO).name.startswith("tiny-llama-v1-")


def test_tiny_llama_builds_loads_and_chats(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = B.ensure_tiny_model(tmp_path, spec=LLAMA_MICRO)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.num_key_value_heads < cfg.num_attention_heads and cfg.max_position_embeddings == 2048
    assert cfg.hidden_act == "silu" and B.is_complete(path, LLAMA_MICRO)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "user: hi\nassistant:"
    ids = tok("12 km →", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
