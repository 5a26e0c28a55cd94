#!/usr/bin/env bash
# One command on a fresh machine: install Elastune with its CPU worker and gateway, then tune, publish
# and serve on the embedded local default (no cluster, no GPU) with `elastune serve -f manifests/serving/`:
# an embedded Redis, local CPU worker processes as the tiny Llama's warm pool, the control core (the
# PromptTuner scheduler, adapter placement) and the OpenAI-compatible gateway on localhost. The TuningJob
# tunes a soft prompt that pulls the city out of person records and publishes it as the model
# `person-city`; the LoRAAdapter `tiny-llama-units` is a rank-8 adapter the project trains offline on
# metric unit conversions. The script ends by asking the base model and both tuned models through the
# gateway with the `openai` client, on held-out records: exact match before (base model) and after
# (tuned), and answers the tuned model gets right. The first run builds the tiny Llama and the adapter
# offline (~3 min on two cores, cached in ~/.cache/elastune or $ELASTUNE_CACHE).
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
# Two cores shared by the build and, later, worker processes: busy-waiting OpenMP threads are ~25x slower.
export OMP_WAIT_POLICY=PASSIVE
# The builds' last line says what they built; the rest (progress bars, warnings) only if one fails.
quiet() { local out; if ! out=$("$@" 2>&1); then echo "$out" >&2; return 1; fi; echo "$out" | tail -1; }
quiet python3 -m elastune_demo.build --arch llama --quiet
quiet python3 -m elastune_demo.adapters --rank 8 --link-into manifests/serving/adapters

PORT=${ELASTUNE_PORT:-8000}
STATE=.elastune/serve
elastune serve -f manifests/serving --port "$PORT" --state-dir "$STATE" "$@" &
SERVE=$!
trap 'kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true' EXIT
python3 - "$PORT" "$STATE" <<'PY'
"""Before and after, through the gateway: the base model and each tuned model on held-out records."""
import sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from openai import OpenAI
from elastune_demo import adapters
from elastune_demo.tasks import SEPARATOR, read_jsonl

BASE = "elastune/tiny-llama"
client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", timeout=120)
job = yaml.safe_load(Path("manifests/serving/tuningjob.yaml").read_text())
spec, published = job["spec"], job["spec"]["output"]["publish"]
deadline = time.monotonic() + 600
while True:  # the tuned prompt is served once its TuningJob succeeds and a pod has loaded it
    try:
        served = {m.id for m in client.models.list().data}
    except Exception:
        served = set()
    if published in served:
        break
    if time.monotonic() > deadline:
        sys.exit(f"quickstart: {published} was not served within 10 minutes (see {sys.argv[2]}/logs)")
    time.sleep(2)


def answer(model: str, prompt: str) -> str:
    text = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    return text.strip().split("\n")[0].strip()


def compare(title: str, records: list, before: tuple[str, str], after: str, source: str) -> None:
    """Exact match of `before` (model, instruction) and `after` on the records, and three answers of
    `after` that are right (where the base model's is wrong, if there are such)."""
    (base, instruction), inputs = before, [r["input"] + SEPARATOR for r in records]
    with ThreadPoolExecutor(8) as pool:  # concurrent requests: the engine batches them
        old = list(pool.map(lambda x: answer(base, instruction + x), inputs))
        new = list(pool.map(lambda x: answer(after, x), inputs))
    score = lambda got: sum(g == r["target"] for g, r in zip(got, records)) / len(records)  # noqa: E731
    shown = f" + {instruction.strip()!r}" if instruction else ""
    print(f"\n{title}\n  exact match on {len(records)} held-out records ({source}):")
    print(f"    before  {base}{shown:<44} {score(old):.2f}\n    after   {after:<63} {score(new):.2f}")
    right = [i for i, r in enumerate(records) if new[i] == r["target"]]
    shown_units: set[str] = set()  # three that differ (another city, another unit)
    for i in sorted(right, key=lambda i: old[i] == records[i]["target"]):
        unit = records[i]["target"].split()[-1]
        if unit not in shown_units and len(shown_units) < 3:
            shown_units.add(unit)
            print(f"  {inputs[i]!r:<42} base model: {old[i]!r:<12} {after}: {new[i]!r}")


status_file = Path(sys.argv[2]) / "status" / f"tuningjob-{job['metadata']['namespace']}-{job['metadata']['name']}.yaml"
st = yaml.safe_load(status_file.read_text())["status"]
compare(
    f"{published}: the soft prompt the TuningJob {job['metadata']['name']} tuned ({st['iterations']} iterations; "
    f"exact match on its eval split {float(st['initialMetric']):.2f} -> {float(st['currentMetric']):.2f})",
    read_jsonl("manifests/data/person-city-heldout.jsonl"),
    (BASE, spec["initialPrompt"] + "\n"),
    published,
    "manifests/data/person-city-heldout.jsonl, not in its dataset",
)
lora = adapters.ADAPTER_SPECS[8]
compare(
    f"tiny-llama-units: the rank-8 LoRA adapter {lora.name} (metric conversions: km, m, kg, l)",
    adapters.held_out_examples(lora),
    (BASE, ""),
    "tiny-llama-units",
    "never trained on",
)
PY
echo "quickstart: done in ${SECONDS} s"
