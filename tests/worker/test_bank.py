"""Prompt Bank: clustering, persistence, lookup, insertion/replacement, new LLMs, errors, CLI (its own,
with explicit inputs, and ``elastune bank``'s demo defaults).

Real torch on a small bank (300 candidates, K = 12) over the 2-layer test variant of the tiny model (the
one test_tuning.py uses, cached under its digest), one torch thread.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("kmedoids")
pytest.importorskip("transformers")

from elastune_contract.vocabulary import Reason  # noqa: E402
from elastune_demo import bank_candidates as C  # noqa: E402
from elastune_demo import bank_cli  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as T  # noqa: E402
from elastune_worker import bank as PB  # noqa: E402
from elastune_worker.bank.__main__ import EXIT_BANK_ERROR  # noqa: E402
from elastune_worker.bank.__main__ import main as bank_main  # noqa: E402
from elastune_worker.bank.features import FeatureExtractor, cosine_distances  # noqa: E402
from elastune_worker.bank.store import BankMeta, cluster  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

from tiny_test_model import TEST_SPEC  # noqa: E402 - the small model of the tuning tests (one cached build)

N_CANDIDATES, K = 300, 12
TASK = T.TaskSpec("units", 1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_build.ensure_tiny_model(spec=TEST_SPEC)


@pytest.fixture(scope="module")
def model_tok(model_dir):
    model, tok = tiny_build.load_tiny_model(model_dir)
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return C.default_candidates(N_CANDIDATES)


@pytest.fixture(scope="module")
def built(model_dir, model_tok, prompts, tmp_path_factory) -> PB.PromptBank:
    model, tok = model_tok
    out = tmp_path_factory.mktemp("bank") / "b"
    return PB.build_bank(model_dir, out, prompts, k=K, seed=0, extractor=FeatureExtractor(model, tok))


@pytest.fixture
def bank(built) -> PB.PromptBank:
    """A fresh copy of the built bank for tests that mutate it."""
    return PB.PromptBank.load(built.path)


@pytest.fixture(scope="module")
def samples() -> list[dict[str, str]]:
    return T.make_task(TASK, n_train=0, n_eval=16, seed=5).eval


# ------------------------------------------------------------------------------------ candidates
def test_candidates_are_many_distinct_and_cover_the_suite():
    full = C.default_candidates()
    assert len(full) == C.DEFAULT_SIZE == 3000 and len(set(full)) == 3000
    assert full == C.default_candidates()  # deterministic
    assert len(C.candidate_pool()) > 3000
    for spec in T.list_tasks():
        assert set(T.partition_instructions(spec)) <= set(full)
        assert len(C.task_cores(spec)) >= 3
    assert all(p.strip() == p and p for p in full)


# ------------------------------------------------------------------------------------ clustering
def test_two_layer_structure(built, prompts):
    assert len(built) == N_CANDIDATES and built.k == K and built.prompts == prompts
    assert np.array_equal(built.labels[built.medoids], np.arange(K))  # each medoid heads its own cluster
    sizes = built.cluster_sizes()
    assert sizes.sum() == N_CANDIDATES and sizes.min() >= 1
    assert sizes.max() <= math.ceil(N_CANDIDATES / K)  # the cap that bounds a lookup's cost
    norms = np.linalg.norm(built.features, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5) and built.meta.feature_dim == 64 * 2  # hidden × blocks
    assert built.meta.seconds_per_row > 0 and built.meta.build["kmedoids"]["algorithm"] == "fasterpam"


def test_unbalanced_clusters_are_nearest_medoid(built):
    labels, medoids, info = cluster(built.features, K, seed=0, balanced=False)
    nearest = np.argmin(cosine_distances(built.features, built.features[medoids]), axis=1)
    assert np.array_equal(labels, nearest) and not info["balanced"]
    b_labels, b_medoids, b_info = cluster(built.features, K, seed=0, balanced=True)
    assert np.array_equal(medoids, b_medoids)  # same FasterPAM medoids, only the assignment is capped
    assert np.bincount(b_labels).max() <= b_info["cap"] == math.ceil(len(labels) / K)


def test_persistence_round_trip_and_restart(built):
    again = PB.PromptBank.load(built.path)
    assert again.prompts == built.prompts
    assert np.array_equal(again.features, built.features) and again.features.dtype == np.float32
    assert np.array_equal(again.labels, built.labels) and np.array_equal(again.medoids, built.medoids)
    assert dataclasses.asdict(again.meta) == dataclasses.asdict(built.meta)
    assert {p.name for p in built.path.iterdir()} == {"bank.json", "features.safetensors"}
    # A fresh interpreter (a restarted pod) reads the same structure.
    code = (
        "import json,sys; from elastune_worker.bank import PromptBank; b = PromptBank.load(sys.argv[1]); "
        "print(json.dumps([len(b), b.k, b.labels.tolist(), b.medoids.tolist(), float(b.features.sum())]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(built.path)], capture_output=True, text=True, check=True
    )
    n, k, labels, medoids, total = json.loads(out.stdout)
    assert (n, k, labels, medoids) == (len(built), built.k, built.labels.tolist(), built.medoids.tolist())
    assert total == pytest.approx(float(built.features.sum()), rel=1e-6)


# ---------------------------------------------------------------------------------------- scoring
def test_soft_score_is_the_tuning_runs_initial_loss(model_dir, model_tok, samples):
    """score(p) uses the tuning loop's layout token for token: equal to the Trainer's loss at step 0."""
    from elastune_worker.tuning.trainer import Trainer, TuningConfig

    model, tok = model_tok
    prompt = T.partition_instructions(TASK)[0]
    cfg = TuningConfig(init_text=prompt, virtual_tokens=8, max_length=96, max_iterations=1, eval_every=1000)
    trainer = Trainer(model_dir, cfg, samples, samples, device="cpu")
    scorer = PB.Scorer(model, tok, samples, virtual_tokens=8, max_length=96)
    assert scorer.score([prompt])[0] == pytest.approx(trainer.evaluate("loss"), abs=1e-5)


def test_text_layout_is_the_corpus_layout(model_tok, samples):
    from elastune_worker.tuning.trainer import encode_record

    model, tok = model_tok
    scorer = PB.Scorer(model, tok, samples, layout="text")
    prompt = "Convert metres to centimetres."
    for rec, enc in zip(scorer.records, scorer._encoded, strict=True):
        joint = tok(T.format_example(rec["input"], rec["target"], prompt), add_special_tokens=False)[
            "input_ids"
        ]
        assert scorer.prompt_ids(prompt) + enc.source + enc.target == [*joint, tok.eos_token_id]
        assert enc == encode_record(tok, rec, scorer._cfg)


@pytest.mark.parametrize("layout", ["soft", "text"])
def test_batched_scoring_equals_one_by_one(model_tok, samples, prompts, layout):
    model, tok = model_tok
    some = prompts[::10]
    batched = PB.Scorer(model, tok, samples, layout=layout, batch_rows=512).score(some)
    single = PB.Scorer(model, tok, samples, layout=layout, batch_rows=1, fast=False).score(some)
    np.testing.assert_allclose(batched, single, rtol=0, atol=1e-5)
    assert len(set(np.round(batched, 4))) > len(some) // 2  # prompts do change the loss


# ----------------------------------------------------------------------------------------- lookup
def test_lookup_cost_and_choice(built, model_tok, samples):
    model, tok = model_tok
    res = PB.lookup(built, model, tok, samples, max_samples=16)
    scorer = PB.Scorer(model, tok, samples)
    first = scorer.score(built.medoid_prompts())
    assert res.cluster == int(np.argmin(first)) and res.medoid_score == pytest.approx(first.min(), abs=1e-9)
    members = built.members(res.cluster)
    # Layer 1 scores K medoids; layer 2 the cluster's other members (the medoid's score is reused).
    assert res.evaluations == K + len(members) - 1 == K + res.cluster_size - 1
    assert res.evaluations <= K + math.ceil(N_CANDIDATES / K) - 1
    second = scorer.score([built.prompts[i] for i in members])
    assert res.prompt == built.prompts[members[int(np.argmin(second))]]
    assert res.score == pytest.approx(second.min(), abs=1e-9)
    assert res.n_samples == 16 and res.candidates == N_CANDIDATES and res.latency_s > 0


def test_lookup_uses_at_most_max_samples_and_skips_unlabelled(built, model_tok, samples):
    model, tok = model_tok
    noisy = [{"input": "no label"}, *samples, {"input": "x", "target": "  "}]
    res = PB.lookup(built, model, tok, noisy, max_samples=4)
    assert res.n_samples == 4
    assert res.prompt == PB.lookup(built, model, tok, samples[:4], max_samples=4).prompt


def test_predicted_lookup_seconds(built):
    expected = PB.predict_lookup_evaluations(built)
    worst = PB.predict_lookup_evaluations(built, "worst")
    assert expected == K + N_CANDIDATES // K - 1 and worst == K + built.cluster_sizes().max() - 1
    s = PB.predict_lookup_seconds(built, 16)
    assert 0 < s <= PB.predict_lookup_seconds(built, 16, "worst")
    assert s == pytest.approx(0.05 + expected * 16 * built.meta.seconds_per_row)


# -------------------------------------------------------------------------- insertion & replacement
def test_insert_joins_the_nearest_medoid(bank, model_tok):
    model, tok = model_tok
    new = "Turn the number of metres into centimetres, please."
    feat = FeatureExtractor(model, tok)([new])[0]
    res = bank.insert(new, feature=feat)
    d = cosine_distances(feat[None, :], bank.features[bank.medoids])[0]
    assert res.inserted and res.reason == "Inserted" and res.cluster == int(np.argmin(d))
    assert res.distance == pytest.approx(d.min()) and res.medoid == bank.prompts[bank.medoids[res.cluster]]
    assert len(bank) == N_CANDIDATES + 1 and bank.labels[-1] == res.cluster and new in bank
    dup = bank.insert(new, feature=feat)
    assert dup.reason == "Duplicate" and not dup.inserted and len(bank) == N_CANDIDATES + 1
    # Without a feature the bank extracts it with its own LLM (loaded from meta.model_dir).
    auto = bank.insert("Give the length in centimetres.")
    assert auto.inserted and len(bank) == N_CANDIDATES + 2


def test_replacement_removes_the_member_closest_to_the_medoid(bank, model_tok):
    model, tok = model_tok
    bank.meta.capacity = len(bank)
    medoids_before = bank.medoid_prompts()
    new_prompts = [f"Please express the distance number {i} from metres in centimetres." for i in range(12)]
    for p, f in zip(new_prompts, FeatureExtractor(model, tok)(new_prompts), strict=True):
        # Expected victim, computed independently on the state before the insertion.
        prompts_all = [*bank.prompts, p]
        feats_all = np.vstack([bank.features, f[None, :]])
        c = int(np.argmin(cosine_distances(f[None, :], bank.features[bank.medoids])[0]))
        m = int(bank.medoids[c])
        members = [i for i in range(len(bank)) if bank.labels[i] == c and i != m] + [len(bank)]
        d = cosine_distances(feats_all[members], feats_all[m][None, :])[:, 0]
        expected = prompts_all[members[int(np.argmin(d))]]

        res = bank.insert(p, feature=f)
        assert res.cluster == c and res.evicted == expected
        assert res.evicted_distance == pytest.approx(float(d.min()))
        assert len(bank) == bank.capacity and expected not in bank  # capacity holds
        assert (res.reason == "Rejected") == (expected == p) and res.inserted == (expected != p)
    assert bank.medoid_prompts() == medoids_before  # a representative is never removed
    assert bank.meta.evicted == len(new_prompts)


def test_replacement_ties_go_to_the_oldest_and_the_new_prompt_can_lose(bank):
    c = 0
    twin = bank.features[bank.medoids[c]].copy()  # at cosine distance 0 from medoid 0: maximally redundant
    others = [i for i in bank.members(c) if i != bank.medoids[c]]
    assert cosine_distances(bank.features[others], twin[None, :]).min() > 0
    bank.meta.capacity = len(bank)
    lone = bank.insert("twin 0", feature=twin)
    assert (lone.reason, lone.inserted, lone.evicted, len(bank)) == (
        "Rejected",
        False,
        "twin 0",
        bank.capacity,
    )
    bank.meta.capacity = len(bank) + 2
    assert (
        bank.insert("twin a", feature=twin).reason == bank.insert("twin b", feature=twin).reason == "Inserted"
    )
    # At capacity, equal distances: the oldest twin goes first, the newest stays.
    assert bank.insert("twin c", feature=twin).evicted == "twin a"
    assert bank.insert("twin d", feature=twin).evicted == "twin b"
    assert len(bank) == bank.capacity and {"twin c", "twin d"} <= set(bank.prompts)


def test_inserted_prompts_survive_a_restart(bank, tmp_path):
    res = bank.insert("Convert metres into centimetres and write cm.")
    bank.save(tmp_path / "saved")
    again = PB.PromptBank.load(tmp_path / "saved")
    assert "Convert metres into centimetres and write cm." in again and len(again) == len(bank)
    assert int(again.labels[again.prompts.index(res.prompt)]) == res.cluster
    assert again.meta.inserted == bank.meta.inserted == 1


# ------------------------------------------------------------------------------------- new LLMs
def _perturbed_copy(model_dir: Path, out: Path) -> Path:
    """Another LLM of the same architecture: same tokenizer, different weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(out)
    return out


def test_features_rebuilt_for_a_new_llm(model_dir, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTUNE_CACHE", str(tmp_path / "cache"))
    some = prompts[:80]
    first = PB.ensure_bank(model_dir, "llm-a", k=6, candidates=some)
    assert first.path == PB.bank_dir("llm-a") and str(first.path).startswith(str(tmp_path / "cache" / "bank"))
    first.insert("Convert metres to centimetres, then stop.")
    first.save()
    same = PB.ensure_bank(model_dir, "llm-a", k=6)  # same LLM: loaded, not rebuilt
    assert same.meta.build["created_at"] == first.meta.build["created_at"] and len(same) == 81
    other_dir = _perturbed_copy(model_dir, tmp_path / "other-llm")
    swapped = PB.ensure_bank(other_dir, "llm-a", k=6)  # the model under this key changed: re-extract
    assert swapped.meta.model_fingerprint != first.meta.model_fingerprint
    assert swapped.prompts == same.prompts  # every gathered prompt, the inserted one included
    assert not np.allclose(swapped.features, same.features, atol=1e-3)
    new = PB.ensure_bank(other_dir, "llm-b", k=6, candidates=some)  # a newly registered LLM
    assert new.path != swapped.path and len(new) == 80
    assert PB.bank_dir("org/model") != PB.bank_dir("org_model")  # safe names never collide


# ----------------------------------------------------------------------------------------- errors
def _reason(exc: pytest.ExceptionInfo[PB.BankError]) -> str:
    return exc.value.reason


def test_errors(built, model_dir, model_tok, samples, tmp_path, monkeypatch):
    model, tok = model_tok
    for none in ([], None):  # the bank has no candidate set of its own: the caller brings one
        with pytest.raises(PB.BankError) as e:
            PB.build_bank(model_dir, tmp_path / "x", candidates=none)
        assert _reason(e) == "EmptyBank"
    empty = PB.PromptBank([], np.zeros((0, 128), np.float32), np.zeros(0), np.zeros(0), BankMeta("m", "", ""))
    with pytest.raises(PB.BankError) as e:
        PB.lookup(empty, model, tok, samples)
    assert _reason(e) == "EmptyBank" and "holds no candidate" in str(e.value)
    with pytest.raises(PB.BankError) as e:
        empty.insert("x", feature=np.zeros(128, np.float32))
    assert _reason(e) == "EmptyBank"

    monkeypatch.setenv("ELASTUNE_CACHE", str(tmp_path))
    with pytest.raises(PB.BankError) as e:
        PB.load_bank("never-built-llm")
    assert _reason(e) == "NoFeatures" and "bank build" in e.value.message
    from transformers import GPT2Config, GPT2LMHeadModel

    narrow = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128))
    with pytest.raises(PB.BankError) as e:  # a bank whose features come from another LLM
        PB.lookup(built, narrow, tok, samples)
    assert _reason(e) == "NoFeatures"

    for bad in ([], [{"input": "5 m"}], [{"input": "5 m", "target": ""}], [{"input": "5 m", "target": None}]):
        with pytest.raises(PB.BankError) as e:
            PB.lookup(built, model, tok, bad)
        assert _reason(e) == "NoTargets"
    with pytest.raises(ValueError):
        PB.BankError("Whatever", "unknown reasons are refused")  # type: ignore[arg-type]


def test_select_initial_prompt_falls_back_and_says_why(built, model_tok, samples, tmp_path):
    model, tok = model_tok
    own = "the job's own prompt"
    ok = PB.select_initial_prompt(built, model, tok, samples, own)
    assert ok.source == "bank" and ok.reason == Reason.PROMPT_BANK_USED and ok.result is not None
    report = ok.to_report()
    assert report.prompt == ok.result.prompt and report.used
    assert None not in (report.score, report.evaluations, report.latency_seconds)
    cases = {
        "NoTargets": PB.select_initial_prompt(built, model, tok, [{"input": "x"}], own),
        "NoFeatures": PB.select_initial_prompt(tmp_path / "missing", model, tok, samples, own),
        "PromptBankDisabled": PB.select_initial_prompt(built, model, tok, samples, own, mode="never"),
        "LatencyBudgetExceeded": PB.select_initial_prompt(built, model, tok, samples, own, budget_s=1e-6),
    }
    for reason, sel in cases.items():
        assert (sel.source, sel.prompt, sel.reason) == ("job", own, reason), sel
        assert sel.to_report().reason == reason and not sel.to_report().used and sel.message
    always = PB.select_initial_prompt(built, model, tok, samples, own, mode="always", budget_s=1e-6)
    assert always.source == "bank"


# -------------------------------------------------------------------------------------------- CLI
def test_cli_build_lookup_insert(model_dir, prompts, samples, tmp_path, capsys):
    """The bank's own command line: a model directory, a candidates file and a JSONL dataset."""
    out, candidates, dataset = tmp_path / "cli-bank", tmp_path / "candidates.txt", tmp_path / "eval.jsonl"
    candidates.write_text("\n".join(prompts[:120]) + "\n")
    dataset.write_text("".join(json.dumps(r) + "\n" for r in samples))
    build = ["build", "--model", str(model_dir), "--out", str(out), "--candidates", str(candidates)]
    assert bank_main([*build, "--k", "8", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["candidates"] == 120 and info["k"] == 8
    args = ["--model", str(model_dir), "--bank", str(out)]
    assert bank_main(["lookup", *args, "--dataset", str(dataset), "--max-samples", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n_samples"] == 8 and res["evaluations"] <= 8 + 15 - 1 and res["predicted_latency_s"] > 0
    assert bank_main(["insert", *args, "Express metres in centimetres, quickly.", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["size"] == 121
    assert bank_main(["info", *args]) == 0 and '"candidates": 121' in capsys.readouterr().out

    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text('{"input": "5 m"}\n')
    assert bank_main(["lookup", *args, "--dataset", str(unlabelled)]) == EXIT_BANK_ERROR
    assert "error: NoTargets:" in capsys.readouterr().err
    none = ["--model", str(model_dir), "--bank", str(tmp_path / "none"), "--dataset", str(dataset)]
    assert bank_main(["lookup", *none]) == EXIT_BANK_ERROR
    assert "error: NoFeatures:" in capsys.readouterr().err
    for missing in (["info"], build[:-2], ["lookup", *args]):  # no model, no candidates, no dataset
        with pytest.raises(SystemExit) as exit_:
            bank_main(missing)
        assert exit_.value.code == 2
    capsys.readouterr()


def test_demo_cli_fills_in_the_tiny_defaults(model_dir, tmp_path, capsys):
    """``elastune bank``: demo candidates for ``build`` and a tiny-suite task for ``lookup``, made
    explicit for the bank's own command line; given inputs pass through."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    model = ["--model", str(model_dir)]
    argv = bank_cli.resolve(["build", *model, "--n", "120", "--k", "8", "--seed", "1"], scratch)
    demo = scratch / "candidates.json"
    assert argv == ["build", *model, "--k", "8", "--candidates", str(demo), "--seed", "1"]
    assert json.loads(demo.read_text()) == C.default_candidates(120, 1)
    given = bank_cli.resolve(["build", *model, "--candidates", "mine.txt"], scratch)
    assert given == ["build", *model, "--candidates", "mine.txt", "--seed", "0"]
    assert bank_cli.resolve(["lookup", "--help"], scratch) == ["lookup", "--help"]  # no model built for help

    out = tmp_path / "demo-bank"
    assert bank_cli.main(["build", *model, "--out", str(out), "--n", "120", "--k", "8"]) == 0
    capsys.readouterr()
    lookup = ["lookup", *model, "--bank", str(out), "--task", "units-01", "--max-samples", "8"]
    assert bank_cli.main([*lookup, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n_samples"] == 8 and res["candidates"] == 120
