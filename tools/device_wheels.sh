#!/usr/bin/env bash
# tools/device_wheels.sh — fill .whl/ (git-ignored) with what tools/device_check.sh carries to the GPU
# machine, which has no network: the wheels of the runtime imports its image lacks (CPython 3.12,
# manylinux x86_64; the versions this venv runs) and the tiny models and adapters built here (so they
# are not rebuilt there). Run it here, then carry ".whl". The data the benchmarks read (data/) is part
# of the working tree, which travels anyway.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
W="$ROOT/.whl"
mkdir -p "$W"
# The GPU image lacks these (it has PyTorch, Triton, transformers and peft); pydantic_core pinned by
# pydantic's own requirement.
pins=$("$PY" -c "
from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in ('pydantic', 'pydantic_core', 'annotated_types', 'typing_inspection', 'redis')))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$W" $pins
"$PY" -c "
import os
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
from elastune_demo import adapters as A, build as B
for spec in (B.DEFAULT_SPEC, B.TINY_LLAMA_SPEC):
    print(B.ensure_tiny_model(spec=spec))
for r in (8, 16, 32, 64):
    print(A.ensure_tiny_adapter(r))" | while read -r d; do
  rel=${d#"${ELASTUNE_CACHE:-$HOME/.cache/elastune}"/}
  mkdir -p "$W/cache/$(dirname "$rel")" && rm -rf "${W:?}/cache/$rel" && cp -r "$d" "$W/cache/$rel"
done
du -sh "$W"
