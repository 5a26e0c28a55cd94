"""The device check's short table (OUTDIR/table.md) from the parts' JSON files; a part that did not
finish shows as missing, never as a figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elastune_bench.device.common import read_part


def _share(r: dict[str, Any] | None) -> str:
    s = (r or {}).get("roofline_share")
    return f"{100 * s:.0f} %" if isinstance(s, (int, float)) else "-"


def _ok(c: Any) -> str:
    if isinstance(c, str):
        return c
    return "ok" if c.get("ok") else "FAILED" + (f" ({c['error'][:80]})" if c.get("error") else "")


def render(out: Path) -> str:
    lines: list[str] = []
    run = read_part(out, "run") or {}
    lines += ["## Device check" + (" (smoke: CPU, tiny shapes)" if run.get("smoke") else ""), ""]
    lines += ["| part | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {s['module']} | {s['status']} | {s.get('seconds', '-')} |" for s in run.get("parts", [])]
    corr = read_part(out, "correctness")
    if corr:
        lines += ["", "| correctness check | result |", "| --- | --- |"]
        lines += [f"| {name} | {_ok(c)} |" for name, c in corr["checks"].items()]
    ceil, eng, hf = read_part(out, "ceilings"), read_part(out, "engine"), read_part(out, "hf_generate")
    if ceil:
        dev = ceil["device"].get("name")
        lines += ["", f"Ceilings on {dev}: copy {ceil['copy_gbps']} GB/s (read + written), "
                  f"bf16 matmul {ceil['matmul_tflops']} TFLOP/s ({ceil['matmul_n']}^3)."]  # fmt: skip
    if eng:
        m = eng["model"]
        lines += ["", f"Engine on {m['shape']} ({m['dtype']}, random weights, {m['weight_gib']} GiB + KV "
                  f"{m['kv_gib']} GiB; element-wise ops: {eng.get('elementwise_backend', 'torch')}):", "",
                  "| run | engine tok/s | share of roofline | transformers tok/s | engine / transformers |",
                  "| --- | --- | --- | --- | --- |"]  # fmt: skip
        hf_decode = (hf or {}).get("decode", {})
        for b, r in eng.get("decode", {}).items():
            h = hf_decode.get(b, {})
            ratio = f"{r['tokens_per_s'] / h['tokens_per_s']:.2f}x" if h.get("tokens_per_s") else "-"
            lines.append(f"| decode b={b}, ctx {r['context']} | {r['tokens_per_s']} | {_share(r)} | "
                         f"{h.get('tokens_per_s', '-')} | {ratio} |")  # fmt: skip
        eager = eng.get("decode_b1_eager")
        if isinstance(eager, dict):
            lines.append(f"| decode b=1 eager (no CUDA graphs) | {eager['tokens_per_s']} | {_share(eager)} | "
                         "- | "
                         f"graphs {eager.get('graphs_speedup', '-')}x eager |")  # fmt: skip
        for b, r in (eng.get("decode_sampled") or {}).items():
            how = ", ".join(f"{k} {v}" for k, v in r["sampling"].items())
            lines.append(f"| decode b={b}, sampled ({how}) | {r['tokens_per_s']} | {_share(r)} | "
                         f"- | {r.get('vs_greedy', '-')}x greedy |")  # fmt: skip
        for b, r in (eng.get("decode_torch_elementwise") or {}).items():
            lines.append(f"| decode b={b}, torch element-wise ops (not fused) | {r['tokens_per_s']} | "
                         f"{_share(r)} | - | fused {r.get('fused_speedup', '-')}x torch ops |")  # fmt: skip
        pre = eng.get("prefill")
        if pre:
            lines.append(f"| prefill {pre['prompts']} x {pre['prompt_len']} | {pre['tokens_per_s']} | "
                         f"{_share(pre)} (of matmul rate) | - | - |")  # fmt: skip
    lora = read_part(out, "lora")
    if lora and "cold_start" in lora:
        on = f" on {lora['model']['shape']}" if "model" in lora else ""
        lines += ["", f"LoRA{on} ({lora.get('emulation', '')}):", "",
                  "| mode | TTFT ms mean / p99 | TPOT ms mean | overhead vs cached (TTFT) |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for mode, r in lora["cold_start"].items():
            over = r.get("overhead_vs_cached_pct", {}).get("ttft_ms_mean", "-")
            lines.append(
                f"| {mode} | {r['ttft_ms_mean']} / {r['ttft_ms_p99']} | {r['tpot_ms_mean']} | {over} % |"
            )
        k = lora.get("kernels", {})
        if k:
            lines.append(f"\nKernels: padded {k['padded']['tokens_per_s']} tok/s, unpadded "
                         f"{k['unpadded']['tokens_per_s']} tok/s.")  # fmt: skip
    co = read_part(out, "coserve")
    on = f" on {co['model']['shape']}" if co and "model" in co else ""
    if co and "goal" in co:
        g = co["goal"]
        lines += ["", f"Co-serving{on} (heavy load): {g['ratio_vs_best_temporal']}x the finetuning "
                  f"tokens/s of {g['best_temporal']}, SLO attainment {g['coserve_slo_attainment_pct']} % vs "
                  f"{g['best_temporal_slo_attainment_pct']} % (FlexLLM: 1.9-4.8x)."]  # fmt: skip
        if "inference_only_slo_attainment_pct" in g:
            within = "within" if g["load_within_capacity"] else "PAST (the comparison measures the overload)"
            alone = g["inference_only_slo_attainment_pct"]
            lines.append(f"Inference alone at that load: SLO attainment {alone} %, {within} the capacity.")
    elif co and "config" in co:  # the run ended before every mode finished: what it has
        done = [f"{m} {load}: {r['finetune_tokens_s']} tok/s, SLO {r['slo_attainment_pct']} %"
                for m in co["config"]["modes"] for load, r in co.get(m, {}).items()]  # fmt: skip
        lines += ["", f"Co-serving{on}, unfinished: " + ("; ".join(done) or "no mode finished")]
    elif co:
        lines += ["", f"Co-serving: {co.get('skipped', 'no result')}"]
    lines += _attention_sweep(read_part(out, "profile_attention"))
    tests = read_part(out, "gpu_tests")
    if tests and "passed" in tests:
        lines += ["", f"GPU test files: {tests['passed']} passed, {len(tests['failed'])} failed, "
                  f"{tests['skipped']} skipped."] + [f"- FAILED {f['test']}: {f['message'][:160]}"
                                                     for f in tests["failed"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def _attention_sweep(att: dict[str, Any] | None) -> list[str]:
    """The extra part's rows: each shape's default launch, its best setting, and gather + SDPA."""
    if not att or not att.get("shapes"):
        return []
    lines = ["", "Decode attention alone (one layer; us, GB/s of K/V read, share of the copy bandwidth):", "",
             "| batch x context | Triton default (splits) | one pass, no splits | best setting "
             "(block_n/warps/stages) | gather + SDPA |", "| --- | --- | --- | --- | --- |"]  # fmt: skip

    def cell(r: dict[str, Any]) -> str:
        return f"{r['us']} us, {r['gb_per_s']} GB/s ({_share({'roofline_share': r.get('share_of_copy')})})"

    for name, r in att["shapes"].items():
        best = r.get("best")
        how = f"{cell(best)} ({best['block_n']}/{best['num_warps']}/{best['num_stages']})" if best else "-"
        one = cell(r["one_pass"]) if "one_pass" in r else "-"
        lines.append(f"| {name} | {cell(r['default'])} ({r['default'].get('splits', 1)}) | {one} | {how} | "
                     f"{cell(r['gather_sdpa'])} |")  # fmt: skip
    return lines
