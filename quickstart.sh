#!/usr/bin/env bash
# One command on a fresh machine: install Elastune with its CPU worker and run the main job on the
# embedded local default — the example TuningJob (manifests/tuningjob.yaml) tuned by `elastune run`:
# an embedded Redis, local CPU worker processes as the warm pool, the PromptTuner scheduler. No cluster,
# no GPU. The first run builds the project's tiny GPT-2 offline (~2 min, cached in ~/.cache/elastune).
# Extra arguments go to `elastune run` (e.g. --workers 1, --channel memcached).
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "quickstart: redis-server is missing (sudo apt-get install redis-server, or brew install redis)" >&2
    exit 1
  fi
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch on its own first and pinned, so resolving the worker extra never swaps in another build.
python3 -c "import torch" 2>/dev/null || python3 -m pip install --quiet torch==2.13.0
python3 -m pip install --quiet -e '.[worker]'
exec elastune run -f manifests/tuningjob.yaml "$@"
