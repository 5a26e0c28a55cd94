#!/usr/bin/env bash
# One command on a fresh machine: install Elastune and run the main job on the embedded local default
# (no cluster, no GPU). Until the local tuning mode lands (issue 3), the main job is the scheduler
# simulation: PromptTuner vs INFless-like vs ElasticFlow-like on a seeded 20-minute medium-load trace.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --quiet --disable-pip-version-check -e .
exec elastune simulate "$@"
