"""The `elastune` command line, run as a real subprocess the way users run it."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastune_cli import extensions, operator_cmd
from elastune_cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


def elastune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastune_cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def test_crds_prints_the_checked_in_crds():
    res = elastune("crds")
    assert res.returncode == 0, res.stderr
    printed = {d["metadata"]["name"]: d for d in yaml.safe_load_all(res.stdout)}
    on_disk = {}
    for f in (ROOT / "crds").glob("*.yaml"):
        d = yaml.safe_load(f.read_text())
        on_disk[d["metadata"]["name"]] = d
    assert printed == on_disk
    assert set(printed) == {"tuningjobs.elastune.dev", "warmpools.elastune.dev", "loraadapters.elastune.dev"}


def test_crds_write(tmp_path):
    res = elastune("crds", "--write", str(tmp_path))
    assert res.returncode == 0, res.stderr
    for f in (ROOT / "crds").glob("*.yaml"):
        assert (tmp_path / f.name).read_text() == f.read_text()


def test_validate_accepts_examples_and_names_bad_fields(tmp_path):
    ok = elastune(
        "validate", *[a for f in sorted((ROOT / "manifests").glob("*.yaml")) for a in ("-f", str(f))]
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count(": valid") == 3

    job = yaml.safe_load((ROOT / "manifests" / "tuningjob.yaml").read_text())
    job["spec"]["deadline"] = "0s"
    job["spec"]["method"] = "fineTuning"
    job["spec"]["foo"] = 1
    del job["spec"]["model"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    res = elastune("validate", "-f", str(bad))
    assert res.returncode == 1
    for field in ("spec.deadline", "spec.method", "spec.foo", "spec.model"):
        assert field in res.stderr, (field, res.stderr)


def test_each_manifest_error_is_said_once_and_a_yaml_decimal_shows_its_quoted_form(tmp_path):
    """Issue 41 item 6: every error was printed twice (the schema's, then "(model)" the models'), and
    `learningRate: 0.01` was refused as "must be of type string"; now once each, with the quoted form."""
    job = yaml.safe_load((ROOT / "manifests" / "tuningjob.yaml").read_text())
    job["spec"]["deadline"] = "0s"
    job["spec"]["method"] = "fineTuning"
    job["spec"].setdefault("hyperparameters", {})["learningRate"] = 0.01
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    res = elastune("validate", "-f", str(bad))
    assert res.returncode == 1
    lines = [line.strip() for line in res.stderr.splitlines()[1:] if line.strip()]
    fields = [line.partition(": ")[0] for line in lines]
    assert len(fields) == len(set(fields)), res.stderr
    assert {"spec.deadline", "spec.method", "spec.hyperparameters.learningRate"} <= set(fields), res.stderr
    assert 'learningRate: "0.01"' in res.stderr
    assert "(model)" not in res.stderr and "^" not in res.stderr  # no raw regular expression


def test_simulate_prints_the_three_schedulers():
    res = elastune("simulate", "--load", "low", "--seed", "3")
    assert res.returncode == 0, res.stderr
    for name in ("promptTuner", "infless", "elasticflow"):
        assert name in res.stdout
    assert "PromptTuner vs infless" in res.stdout


def test_bench_scheduler_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    res = elastune("bench", "scheduler", "--quick", "--seeds", "1", "--json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    for pol in ("promptTuner", "infless", "elasticflow"):
        cell = data["medium_S1.0"][pol]
        assert cell["slo_violation_pct"] >= 0 and cell["cost_usd"] > 0
    assert data["round_ms"]["mean"] > 0 and data["round_ms"]["max"] >= data["round_ms"]["mean"]
    assert data["round_ms"]["gpus"] == 1000 and data["round_ms"]["min_pending_jobs"] >= 1000
    assert set(data["ablations"]) == {
        "workloadScheduler",
        "withoutWarmAllocator",
        "withoutDelaySchedulable",
        "withoutLatencyBudget",
    }
    assert len(data["idle_window"]) == 5
    assert len(data["end_to_end"]) == 9
    assert data["config"]["headline_profile"] == "calibrated"
    ratio_keys = {"slo_vs_infless", "slo_vs_elasticflow", "cost_vs_infless", "cost_vs_elasticflow"}
    for name in ("calibrated", "heavy"):
        prof = data["profiles"][name]
        assert set(prof["grid_max"]) == ratio_keys == set(prof["grid_max_all_spend"])
        assert set(prof["end_to_end"]["low_S0.5"]["ratios_all_spend"]) == ratio_keys
        assert set(prof["grid_max_at"].values()) <= set(prof["end_to_end"])
        assert len(prof["end_to_end"]) == 9
        cell = prof["end_to_end"]["medium_S1.0"]
        assert cell["versus_paper"]["paper"]["cost_saving_vs_infless"] == 0.23
        for pol in ("promptTuner", "infless", "elasticflow"):
            g = cell[pol]["gpu_seconds"]
            assert g["busy"] + g["idle"] + g["starting_held"] == pytest.approx(g["paid"], rel=1e-3)
        assert set(prof["cost_breakdown"]["medium_S1.0"]) == {"promptTuner", "infless", "elasticflow"}
        assert set(prof["anchors"]) == {
            "pt_violation_pct",
            "pt_cost_usd",
            "ef_utilization_pct",
            "infless_init_wait_pct",
        }
        assert set(prof["ablation"]) == {
            "workloadScheduler",
            "withoutWarmAllocator",
            "withoutDelaySchedulable",
            "withoutLatencyBudget",
            "withIdleWindowColdStart",
            "withBankMinSpeedupSizing",
            "withEarlyRelease",
            "withAllSpendMechanisms",
        }
        for row in prof["ablation"].values():
            assert row["slo_violation_pct"] >= 0 and row["cost_usd"] > 0 and set(row["ratios"]) == ratio_keys
        assert prof["ablation"]["workloadScheduler"]["paper"] == {"slo_violation_pct": 12.4, "cost_usd": 22.9}
    assert data["end_to_end"] == data["profiles"]["calibrated"]["end_to_end"]
    assert {
        "pt_violation_pct",
        "pt_cost_usd",
        "grid_max_slo_vs_infless",
        "heavy_ahead_at_every_setting",
    } <= set(data["targets"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_scheduler_runs_one_profile(tmp_path):
    out = tmp_path / "b.json"
    res = elastune("bench", "scheduler", "--quick", "--seeds", "1", "--profile", "heavy", "--json", str(out))
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert list(data["profiles"]) == ["heavy"] and data["config"]["headline_profile"] == "heavy"
    assert "heavy_ahead_at_every_setting" in data["targets"]


def test_bench_operator_says_what_to_install_without_the_dev_extras(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "kmock" else real(name, *a)
    )
    assert cli.main(["bench", "operator", "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "missing: kmock" in err and "pip install -e '.[dev]'" in err


def test_bench_is_found_through_its_entry_point_and_lists_every_benchmark():
    from importlib.metadata import entry_points

    (ep,) = entry_points(group=extensions.GROUP, name="bench")
    assert ep.value == "elastune_bench.cli:main"
    res = elastune("bench", "--help")
    assert res.returncode == 0, res.stderr
    for name in (
        "scheduler",
        "coserve-sim",
        "operator",
        "sync",
        "bank",
        "serve",
        "lora",
        "route",
        "gateway",
        "tenancy",
        "ssjf",
        "chaos",
        "coserve",
    ):
        assert re.search(rf"^    {name}\b", res.stdout, re.MULTILINE), (name, res.stdout)
    res = elastune("bench", "serve", "--help")  # the benchmark's own parser
    assert res.returncode == 0 and res.stdout.startswith("usage: elastune bench serve"), res.stderr
    assert "--no-vllm" in res.stdout


def test_the_product_cli_imports_no_benchmark_and_says_when_they_are_missing(monkeypatch, capsys):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: ())
    assert cli.main(["bench", "scheduler", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "elastune_bench" in err and "not installed" in err


def test_an_unknown_benchmark_is_a_usage_error():
    res = elastune("bench", "nosuch")
    assert res.returncode == 2 and "invalid choice: 'nosuch'" in res.stderr


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    res = elastune("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"elastune {version('elastune')}"


def test_help_lists_every_command_the_operator_included():
    res = elastune("--help")
    assert res.returncode == 0, res.stderr
    listed = set(re.findall(r"^    (\w[\w-]*)", res.stdout, re.MULTILINE))
    assert {
        "crds", "validate", "run", "serve", "operator", "worker", "gateway", "bank", "simulate", "calibrate",
        "bench",
    } <= listed, res.stdout  # fmt: skip


def test_operator_help_says_it_runs_kopf_and_lists_flags_kopf_run_has():
    """`elastune operator --help` is ours (it used to start kopf); each flag it documents exists in
    `kopf run`, which gets the arguments verbatim (kopf renames or drops one: this fails)."""
    res = elastune("operator", "--help")
    assert res.returncode == 0, res.stderr
    assert "kopf run -m elastune_operator.k8s.handlers" in " ".join(res.stdout.split())
    kopf = subprocess.run(
        [sys.executable, "-m", "kopf", "run", "--help"], capture_output=True, text=True, check=True
    )
    for names, _, _ in operator_cmd.KOPF_RUN_FLAGS:
        for flag in names:
            assert flag in res.stdout, flag
            assert re.search(rf"(^|[\s,/]){re.escape(flag)}\b", kopf.stdout), (flag, kopf.stdout)


def test_operator_arguments_go_to_kopf_run():
    """Everything after `operator` reaches kopf's own parser: an unknown flag is kopf's usage error
    (no cluster is contacted: click stops at the flag)."""
    res = elastune("operator", "--no-such-flag")
    assert res.returncode == 2
    assert "No such option '--no-such-flag'" in res.stderr and "kopf run" in res.stderr, res.stderr


def test_simulate_and_calibrate_are_found_through_entry_points_and_the_cli_never_imports_bench():
    from importlib.metadata import entry_points

    for name, value in (
        ("simulate", "elastune_bench.sim.scheduling.simulate:main"),
        ("calibrate", "elastune_bench.sim.scheduling.calibrate:main"),
    ):
        (ep,) = entry_points(group=extensions.GROUP, name=name)
        assert ep.value == value
    res = elastune("simulate", "--help")
    assert res.returncode == 0 and res.stdout.startswith("usage: elastune simulate"), res.stderr
    probe = (
        "import sys; from elastune_cli.main import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in sys.modules if m.startswith(('elastune_bench', 'elastune_testing'))))"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


def test_simulate_says_what_to_install_without_the_benchmarks(monkeypatch, capsys):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: ())
    assert cli.main(["simulate", "--load", "low"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elastune simulate:") and "elastune_bench" in err and "not installed" in err
