#!/usr/bin/env bash
# One command on a fresh machine: install what the tests need, then run them.
# Arguments go to pytest (e.g. ./test.sh tests/operator/scheduling/test_prompttuner.py -x). `.ci/run` calls exactly this.
#
# 1. Debian packages: real Redis and Memcached servers (started by test fixtures, never as daemons) and
#    promtool (package prometheus; without systemd its daemon never starts) for metrics and dashboards.
# 2. torch pinned and alone first: the CPU wheel (a bare `torch`, or a range resolved together with
#    other packages, can pull a multi-GB CUDA build).
# 3. The project with every extra the tests use: dev (pytest, ruff, import-linter, mypy, emulator, chart
#    tools) and worker (transformers, peft, ...).
set -euo pipefail
cd "$(dirname "$0")"
export PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# Two cores shared by test processes: busy-waiting OpenMP threads make torch ~25x slower.
export OMP_WAIT_POLICY=PASSIVE

step() { echo "test.sh: $1 (${SECONDS}s)" >&2; }
missing=()
for bin in redis-server memcached promtool; do command -v "$bin" >/dev/null || missing+=("$bin"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends redis-server memcached prometheus >/dev/null
    step "installed redis-server memcached prometheus"
  else
    echo "test.sh: missing ${missing[*]}: sudo apt-get install redis-server memcached prometheus" >&2
    exit 1
  fi
fi

python3 -c "import torch" 2>/dev/null || { python3 -m pip install --quiet torch==2.13.0 && step "installed torch"; }
python3 -m pip install --quiet -e '.[dev,worker,gateway]'
step "installed elastune[dev,worker,gateway]; running pytest"

# Two pytest-xdist workers (much of the suite waits on the servers and pods it starts: one process keeps
# two cores ~40 % busy); each module's tests on one worker, in order, and the pod world's modules
# together (tests/conftest.py: the scheduler). ELASTUNE_TEST_WORKERS=0 runs them in one process.
exec python3 -m pytest -n "${ELASTUNE_TEST_WORKERS:-2}" "$@"
