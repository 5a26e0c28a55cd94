"""SSJF's output-length predictor: the build's split, metrics and cache key; loading and predicting."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from elastune_common import datasets
from elastune_ssjf import build as B


def test_spearman_and_mae_helpers():
    assert B.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert B.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert B.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.8660254)  # ties share their rank
    assert B.spearman([5, 5, 5], [1, 2, 3]) is None  # a constant prediction ranks nothing
    assert B.mae([1, 2, 3], [2, 2, 5]) == pytest.approx(1.0)


def _entry(prompt: str, source: str, length: int = 10) -> B.Entry:
    return B.Entry(prompt, length, 0.0, source)


def test_the_split_holds_a_whole_source_out_and_refuses_a_leaked_record():
    entries = [_entry("a", "s1"), _entry("b", "s2"), _entry("c", "held"), _entry("d", "held")]
    assert B.split_by_source(entries, "held") == ([0, 1], [2, 3])
    # the same question in a training source (whitespace aside) is a leak, not a test record
    leaky = [*entries, _entry(" d\n", "s1")]
    with pytest.raises(ValueError, match="also occur in training"):
        B.split_by_source(leaky, "held")
    with pytest.raises(ValueError, match="no entry"):
        B.split_by_source(entries, "absent")


def test_the_evaluation_reports_a_held_out_source_no_training_record_comes_from(predictor_dir: Path):
    """What build_info reports as held out is one source, apart from every training source, and none of
    its prompts is among the training prompts (dataset_predictions.json lists both sides' digests)."""
    info = B.read_build_info(predictor_dir)
    assert info is not None
    split = info["split"]
    held, trained = split["held_out_sources"], split["train_sources"]
    assert set(held) == {info["spec"]["held_out_source"]} == {"alpacaeval/selfinstruct"}
    assert not set(held) & set(trained) and {"sharegpt", "alpacaeval/oasst"} <= set(trained)
    shipped = B.training_entries()
    assert (
        held
        == {"alpacaeval/selfinstruct": sum(e.source in held for e in shipped)}
        == {"alpacaeval/selfinstruct": info["metrics"]["test"]["n"]}
    )
    assert sum(trained.values()) + info["metrics"]["test"]["n"] == len(shipped) == info["dataset"]["entries"]
    preds = json.loads((predictor_dir / "dataset_predictions.json").read_text())
    held_ids, train_ids = preds["split"]["held_out_prompts"], set(preds["split"]["train_prompts"])
    assert len(held_ids) == info["metrics"]["test"]["n"] and not set(held_ids) & train_ids
    assert held_ids == [B.prompt_digest(e.prompt) for e in shipped if e.source in held]


def test_build_info_reports_held_out_metrics_and_the_median_baseline(predictor_dir: Path):
    info = B.read_build_info(predictor_dir)
    assert info is not None and info["name"] == "ssjf-predictor-v1"
    assert predictor_dir.name == "ssjf-predictor-v1" and predictor_dir.parent.name == "models"
    test, loso = info["metrics"]["test"], info["metrics"]["loso"]
    assert test["n"] == 252 and set(loso) == {*info["split"]["train_sources"], "mean_spearman"}
    # On the source it never saw, the head ranks prompts (what SJF needs) well above chance and its
    # error is below the training median's: the figures of docs/benchmarks/ssjf.md.
    assert test["spearman"] > 0.4 and test["mae_tokens"] < test["baseline_mae_tokens"]
    assert loso["mean_spearman"] > 0.35
    preds = json.loads((predictor_dir / "dataset_predictions.json").read_text())
    assert len(preds["held_out"]) == 252 and all(isinstance(v, int) and v >= 1 for v in preds["held_out"])


def test_the_cache_key_covers_format_spec_and_encoder(predictor_dir: Path, tmp_path: Path):
    assert B.is_complete(predictor_dir)
    copy = tmp_path / "p"
    shutil.copytree(predictor_dir, copy)
    assert B.is_complete(copy)
    info = json.loads((copy / "build_info.json").read_text())
    for key, value in (("format_version", -1), ("encoder", {"package": "another"})):
        (copy / "build_info.json").write_text(json.dumps({**info, key: value}))
        assert not B.is_complete(copy)
    (copy / "build_info.json").write_text(json.dumps(info))
    assert not B.is_complete(copy, B.PredictorSpec(ridge_alpha=1.0))
    assert B.model_dir(tmp_path, B.PredictorSpec(ridge_alpha=1.0)).name.startswith("ssjf-predictor-v1-")


def test_predictor_loads_and_predicts_ints_for_strings(predictor_dir: Path):
    import torch

    from elastune_ssjf.predictor import LengthPredictor

    torch.set_num_threads(1)
    p = LengthPredictor.load(predictor_dir)
    prompts = ["hi", "Write a detailed, 2000-word essay on the history of Rome.", "", "word " * 3000]
    out = p.predict(prompts)
    assert len(out) == 4 and all(type(v) is int and v >= 1 for v in out)
    assert p.predict(prompts[1:2]) == out[1:2]  # the same alone as in a batch
    assert p.predict([]) == []
    # head + tail truncation to the encoder's 512 positions
    ids = p.encoder.token_ids("alpha " * 300 + "beta " * 400)
    alpha, beta = p.encoder.token_ids("alpha")[1], p.encoder.token_ids("beta")[1]
    assert len(ids) == 512 and ids[1:129] == [alpha] * 128 and ids[129:-1] == [beta] * 382


def test_the_build_trains_on_the_shipped_data_and_records_its_digests(predictor_dir: Path, monkeypatch):
    """The default training data is the repository's gzipped samples; the digests build_info records are
    the data's (the uncompressed JSON), so the same entries give the same digest however packed."""
    shipped = [datasets.DATA_DIR / datasets.SHAREGPT_FILE, datasets.DATA_DIR / datasets.ALPACAEVAL_FILE]
    monkeypatch.delenv(datasets.DATASET_ENV, raising=False)
    assert [B.default_dataset(), datasets.alpacaeval_path()] == shipped
    info = B.read_build_info(predictor_dir)
    assert info is not None
    assert info["dataset"]["paths"] == ["data/sharegpt_250.json.gz", "data/alpacaeval_gpt35_0301.json.gz"]
    assert info["dataset"]["sha256"] == {
        f.name: hashlib.sha256(gzip.decompress(f.read_bytes())).hexdigest() for f in shipped
    }
    assert [len(B.load_dataset(f)) for f in shipped] == [250, 805]
