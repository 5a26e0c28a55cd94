#!/usr/bin/env bash
# The peer routers of `elastune bench route`: vllm-router and SGLang's smg (sglang-router) from their
# PyPI wheels (each ships a Rust binary) in their own venv, so their pins never touch Elastune's
# environment. Idempotent; prints the venv's bin directory.
#   tools/peer_routers_venv.sh        # create or reuse ${ELASTUNE_CACHE:-~/.cache/elastune}/venvs/routers
set -euo pipefail
VENV="${ELASTUNE_CACHE:-$HOME/.cache/elastune}/venvs/routers"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -x "$VENV/bin/vllm-router" ] && [ -x "$VENV/bin/smg" ]; then
  echo "$VENV/bin"; exit 0
fi
echo "peer_routers_venv: creating $VENV (vllm-router==0.1.17, sglang-router==0.3.2)" >&2
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet vllm-router==0.1.17 sglang-router==0.3.2
echo "$VENV/bin"
