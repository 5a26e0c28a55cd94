#!/usr/bin/env bash
# tools/device_check.sh [--smoke] OUTDIR [--parts a,b] — the prepared GPU check of issue 26, made to run once on a
# borrowed GPU machine (one H100 or H200 with PyTorch, Triton, transformers and peft; no network) in
# at most 8 minutes, and with --smoke on any CPU in under 3 (once the tiny models are cached: a first run
# on a fresh machine builds them, untimed, before the parts). It first checks which of the project's
# runtime imports the machine lacks and installs only those from the wheels carried in .whl/
# (tools/device_wheels.sh fetches them and the tiny models there: carry ".whl"; the ShareGPT trace is
# the tree's own data/),
# puts the project on PYTHONPATH, then runs bench/elastune_bench/device/run.py: (a)
# correctness on the device (greedy equality with transformers for the tiny Llama and GPT-2, LoRA with
# both kernels and a soft prompt against peft, each attention backend against the gather reference,
# CUDA graphs on vs off); (b) the copy bandwidth and bf16 matrix rate, then the engine on a random
# Llama-3-8B-shaped model (decode tokens/s at batch 1/16/64/256 with 512-token contexts and prefill
# tokens/s of 2,048-token prompts, each as a share of its roofline) and transformers' generate on the
# same shape; (c) `elastune bench lora` with real host-to-device copies and `elastune bench coserve`
# on the GPU. Each part runs in its own process under its own time box and writes OUTDIR/<part>.json
# as soon as it finishes; OUTDIR/table.md is printed last. PYTHON picks the interpreter (python3).
set -uo pipefail
SMOKE=()
if [[ "${1:-}" == "--smoke" ]]; then SMOKE=(--smoke); shift; fi
OUT=${1:?usage: tools/device_check.sh [--smoke] OUTDIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
START=$(date +%s)

# What the measured code imports beyond torch/triton/transformers/peft (which the GPU image has).
NEEDED="numpy yaml safetensors tokenizers pydantic pydantic_core annotated_types typing_inspection redis"
missing=$("$PY" -c "
import importlib.util, sys
print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))" $NEEDED)
if [[ -n "$missing" ]]; then
  echo "device_check: missing here: $missing"
  if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    SITE=${TMPDIR:-/tmp}/elastune-device-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$ROOT"/.whl/*.whl || echo "device_check: installing the carried wheels failed"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "device_check: no wheels in $ROOT/.whl (run tools/device_wheels.sh here, carry .whl)"
  fi
fi
# The tree's own packages always come first: an interpreter with an older install of some of them
# (or none of the newer ones) must still run the code that travelled.
TREE=""
for pkg in contract common worker operator gateway ssjf testing bench; do TREE="$TREE${TREE:+:}$ROOT/$pkg"; done
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
# The tiny models and adapters built here (else they are built there: minutes). The benchmarks find
# data/ in the tree through elastune_common.datasets; $ELASTUNE_DATASET, if set, still overrides it.
if [[ -d "$ROOT/.whl/cache" && -z "${ELASTUNE_CACHE:-}" ]]; then
  export ELASTUNE_CACHE=${TMPDIR:-/tmp}/elastune-device-cache
  mkdir -p "$ELASTUNE_CACHE" && cp -rn "$ROOT/.whl/cache/." "$ELASTUNE_CACHE/"
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
still=$("$PY" -c "
import importlib.util, sys
print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))" $NEEDED elastune_worker)
[[ -n "$still" ]] && echo "device_check: still missing: $still (the parts that need them will fail)"
echo "device_check: set up in $(( $(date +%s) - START )) s; python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
"$PY" -m elastune_bench.device.run "${SMOKE[@]}" "$OUT" "${@:2}"
rc=$?
echo "device_check: done in $(( $(date +%s) - START )) s (exit $rc)"
exit $rc
