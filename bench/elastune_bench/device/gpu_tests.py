"""Part d (extra): the test files whose GPU cases run only on a GPU, run there: CUDA graphs (capture,
replay, LoRA in the graph, capture failures), the Triton paged attention (compiled, float32 and bfloat16,
flash-decoding's splits), the fused element-wise kernels (bfloat16 rounding as torch's), the Triton LoRA
kernels (compiled, bfloat16), LoRA loads from pinned memory and no kernel compiled while serving (the
compiled-kernel cache must not grow). On the CPU these files run through Triton's interpreter in CI;
here their CUDA-only assertions run too. pytest's JUnit report is read into gpu_tests.json: counts, and
each failure's test id and message. The CPU smoke run takes one quick case, so that the part cannot
rot."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from elastune_bench.device.common import device_info, part_args, write_part

ROOT = Path(__file__).resolve().parents[3]
FILES = (
    "tests/worker/engine/model_runner/test_cuda_graphs.py",
    "tests/worker/engine/model_runner/test_triton_attention.py",
    "tests/worker/engine/model_runner/test_fused_ops.py",
    "tests/worker/engine/model_runner/test_kernel_variants.py",
    "tests/worker/engine/model_runner/test_lora_sgmv.py",
    "tests/worker/engine/model_runner/test_lora_slots.py",
)
SMOKE_SELECTION = ("tests/worker/engine/model_runner/test_fused_ops.py", "-k", "no_rows_and_bad_inputs")


def junit_summary(report: Path) -> dict[str, Any]:
    """Counts and failures of a pytest JUnit XML report."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            failed.append({"test": name, "message": (bad.get("message") or "")[:500]})
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, **counts, "failed": failed}


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    selection = list(SMOKE_SELECTION if args.smoke else FILES)
    report = args.out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *selection]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (args.out / "logs").mkdir(exist_ok=True)
    (args.out / "logs" / "gpu_tests.pytest.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = {"device": device_info("cuda" if not args.smoke else "cpu"),
                              "selection": selection, "pytest_exit": proc.returncode}  # fmt: skip
    if report.exists():
        result |= junit_summary(report)
    else:
        result["error"] = (proc.stdout + proc.stderr)[-2000:]
    write_part(args.out, "gpu_tests", result)
    print(f"gpu tests: {result.get('passed')} passed, {len(result.get('failed', []))} failed, "
          f"{result.get('skipped')} skipped (pytest exit {proc.returncode})", flush=True)  # fmt: skip
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
