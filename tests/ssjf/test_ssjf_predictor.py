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


def test_split_is_fixed_disjoint_and_eighty_twenty():
    train, test = B.split(250, B.DEFAULT_SPEC)
    assert (len(train), len(test)) == (200, 50)
    assert sorted(train + test) == list(range(250))
    assert B.split(250, B.DEFAULT_SPEC) == (train, test)
    parts = B.folds_of(train, 5)
    assert [len(p) for p in parts] == [40] * 5 and [i for p in parts for i in p] == train


def test_build_info_reports_held_out_metrics_and_the_median_baseline(predictor_dir: Path):
    info = B.read_build_info(predictor_dir)
    assert info is not None and info["name"] == "ssjf-predictor-v1"
    assert predictor_dir.name == "ssjf-predictor-v1" and predictor_dir.parent.name == "models"
    test, cv = info["metrics"]["test"], info["metrics"]["cv_train"]
    assert test["n"] == 50 and cv["n"] == 200
    for m in (test, cv):
        assert m["mae_tokens"] > 0 and m["baseline_mae_tokens"] > 0
    # The head ranks prompts (what SJF needs) far better than chance, and beats the median on CV.
    assert test["spearman"] > 0.2 and cv["spearman"] > 0.2
    assert cv["mae_tokens"] < cv["baseline_mae_tokens"]
    preds = json.loads((predictor_dir / "dataset_predictions.json").read_text())
    oof = preds["out_of_fold"]
    assert len(oof) == 250 and all(isinstance(v, int) and v >= 1 for v in oof)


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
    assert not B.is_complete(copy, B.PredictorSpec(hidden=64))
    assert B.model_dir(tmp_path, B.PredictorSpec(hidden=64)).name.startswith("ssjf-predictor-v1-")


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


def test_the_build_trains_on_the_shipped_data_and_records_its_digest(predictor_dir: Path, monkeypatch):
    """The default training data is the repository's gzipped sample; the digest build_info records is
    the data's (the uncompressed JSON), so the same entries give the same digest however packed."""
    shipped = datasets.DATA_DIR / datasets.SHAREGPT_FILE
    monkeypatch.delenv(datasets.DATASET_ENV, raising=False)
    assert B.default_dataset() == shipped
    raw = gzip.decompress(shipped.read_bytes())
    info = B.read_build_info(predictor_dir)
    assert info is not None
    assert info["dataset"]["sha256"] == hashlib.sha256(raw).hexdigest()
    assert info["dataset"]["entries"] == len(B.load_dataset(shipped)) == 250
