"""The repository carries everything it needs (issue 41): no file points outside the checkout, and the
data the tests and benchmarks read ships in data/ and is found there without any setting."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elastune_common import datasets

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces so that this file does not match its own search.
OUTSIDE = ("../" + "shared", "/work/" + "shared")


def _repository_files() -> list[Path]:
    """The files git tracks: what a clone of the repository holds."""
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.decode(errors='replace').strip()}")
    return [ROOT / p for p in res.stdout.decode().split("\0") if p]


def test_no_file_names_a_folder_outside_the_repository():
    offenders = []
    for path in _repository_files():
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [
            f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
            for n, line in enumerate(text.splitlines(), 1)
            if any(o in line for o in OUTSIDE)
        ]
    assert not offenders, "files that point outside the repository:\n" + "\n".join(offenders)


# -- the data shipped in data/ ----------------------------------------------------------------------
SHIPPED_MAX_BYTES = 320 * 1024
"""Each data file stays small (issue 41: "keep it small"); a bigger sample belongs in a script. 320 KiB:
the SSJF predictor's held-out source (AlpacaEval, 292 KiB gzipped) is the largest."""


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(datasets.DATASET_ENV, raising=False)


def test_the_shipped_data_is_found_in_the_checkout_with_no_setting(no_override):
    readme = (ROOT / "data" / "README.md").read_text()
    shipped = sorted((ROOT / "data").glob("*.gz"))
    assert {datasets.sharegpt_path(), datasets.azure_trace_path()} <= set(shipped)
    for path in shipped:
        assert path.parent == ROOT / "data" and path.is_file(), path
        assert path.read_bytes()[:2] == b"\x1f\x8b" and path.stat().st_size < SHIPPED_MAX_BYTES, path
        assert f"`{path.name}`" in readme  # its source and licence are named there
    assert datasets.display_path(datasets.sharegpt_path()) == "data/sharegpt_250.json.gz"


def test_every_reader_defaults_to_the_shipped_data(no_override):
    from elastune_bench.serving import ssjf as bench_ssjf
    from elastune_bench.sim.routing.workloads import azure_trace, load_sharegpt
    from elastune_ssjf.build import default_dataset, load_dataset

    pairs = load_sharegpt()
    assert len(pairs) == 250 and pairs[0] == (19, 206)  # the first entry's prompt and response tokens
    rows = azure_trace()
    assert len(rows) == 19_366 and (rows[0].context_tokens, rows[0].generated_tokens) == (374, 44)
    assert rows[1].arrival == pytest.approx(4.314579) and rows[-1].arrival < 3600  # one hour
    assert default_dataset() == datasets.sharegpt_path() and len(load_dataset()) == 250
    assert bench_ssjf.parser().parse_args([]).dataset == datasets.sharegpt_path()


def test_gzipped_and_plain_copies_read_the_same(tmp_path):
    from elastune_bench.sim.routing.workloads import azure_trace

    plain = tmp_path / "sharegpt.json"
    plain.write_bytes(datasets.read_bytes(datasets.sharegpt_path()))
    assert datasets.read_json(plain) == datasets.read_json(datasets.sharegpt_path())
    trace = tmp_path / "trace.csv"
    with datasets.open_text(datasets.azure_trace_path()) as f:
        trace.write_text(f.read())
    assert azure_trace(trace, limit=50) == azure_trace(limit=50)


def test_elastune_dataset_names_another_sharegpt_file_for_every_reader(tmp_path, monkeypatch):
    from elastune_bench.serving import ssjf as bench_ssjf
    from elastune_bench.sim.routing.workloads import load_sharegpt
    from elastune_ssjf.build import default_dataset, load_dataset

    own = tmp_path / "mine.json"
    entry = {"prompt": "hi", "response": "hello", "prompt_length": 3, "response_length": 5}
    own.write_text(json.dumps({"entries": [entry]}))
    monkeypatch.setenv(datasets.DATASET_ENV, str(own))
    assert load_sharegpt() == [(3, 5)] and [e.response_length for e in load_dataset()] == [5]
    assert default_dataset() == own == bench_ssjf.parser().parse_args([]).dataset
    assert datasets.display_path(own) == str(own)  # outside the checkout: as given


def test_benchmark_results_name_their_data_by_its_path_in_the_repository():
    for result in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        config = json.loads(result.read_text()).get("config", {})
        if "dataset" in config:
            assert (ROOT / config["dataset"]).is_file(), f"{result.name}: {config['dataset']}"
