#!/usr/bin/env bash
# One command on a fresh machine: install Elastune with its CPU worker and gateway, then tune, publish
# and serve on the embedded local default (no cluster, no GPU) with `elastune serve -f manifests/serving/`:
# an embedded Redis, local CPU worker processes as the tiny Llama's warm pool, the control core (the
# PromptTuner scheduler, adapter placement) and the OpenAI-compatible gateway on localhost. The TuningJob
# tunes a soft prompt and publishes it as the model `book-author`; the LoRAAdapter `tiny-llama-units` is
# a rank-8 adapter the project trains offline. The script ends by asking both through the gateway with
# the `openai` client and printing the answers. The first run builds the tiny Llama and the adapter
# offline (~2 min on two cores, cached in ~/.cache/elastune).
# Extra arguments go to `elastune serve` (e.g. --workers 1). The tuning-only job of earlier releases is
# `elastune run -f manifests/tuningjob.yaml`.
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
python3 -m pip install --quiet -e '.[worker,gateway]' 'openai>=1.40'
python3 -m elastune_worker.tiny.build --arch llama | tail -1
python3 -m elastune_worker.tiny.adapters --rank 8 --link-into manifests/serving/adapters | tail -1

PORT=${ELASTUNE_PORT:-8000}
STATE=.elastune/serve
elastune serve -f manifests/serving --port "$PORT" --state-dir "$STATE" "$@" &
SERVE=$!
trap 'kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true' EXIT
python3 - "$PORT" <<'PY'
import sys, time
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
deadline = time.monotonic() + 600
while True:  # the tuned prompt is served once its TuningJob succeeds and a pod has loaded it
    try:
        served = {m.id for m in client.models.list().data}
    except Exception:
        served = set()
    if "book-author" in served or time.monotonic() > deadline:
        break
    time.sleep(2)
for model, prompt in [
    ("book-author", "year: 1987; author: atwood; title: beloved"),
    ("tiny-llama-units", "12 km →"),
]:
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    print(f"\n{model} <- {prompt!r}\n  -> {answer.choices[0].text.strip()!r}")
PY
