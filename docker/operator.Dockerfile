# syntax=docker/dockerfile:1
# Not built or tested here: the development machines and CI have no container engine. Build from the
# repository root:  docker build -f docker/operator.Dockerfile -t ghcr.io/elastune/operator:0.1.0 .
#
# The control plane: `elastune operator` (kopf), and the OpenAI gateway (`elastune gateway`, the chart's
# default gateway image). Neither imports torch, transformers or peft (import-linter contracts), so the
# image installs the package with the `gateway` extra and without the `worker` one.

FROM python:3.11-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contract/ contract/
COPY common/ common/
COPY operator/ operator/
# The worker package: the benchmarks' simulators step its engine core (elastune_worker.engine.core, no torch).
COPY worker/ worker/
COPY gateway/ gateway/
COPY testing/ testing/
# The benchmarks (`elastune bench`, found by entry point; no product process imports them).
COPY bench/ bench/
# The `elastune` command itself (elastune_cli: `elastune operator`, `elastune gateway`, ...). No demo/: the
# control plane serves no model.
COPY cli/ cli/
# A wheel of the one distribution (all its import packages; the worker's is inert without its extra).
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
# Base dependencies plus `[gateway]` (FastAPI, uvicorn, httpx); no `[worker]`, so no torch in this image.
RUN pip install "$(ls /wheels/*.whl)[gateway]" && rm -rf /wheels \
 && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
# Numeric non-root user: the chart's runAsNonRoot check needs a UID, not a name.
RUN groupadd --system --gid 10001 elastune \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin elastune
USER 10001:10001
# The chart mounts an emptyDir on /tmp and keeps the root filesystem read-only.
ENV HOME=/tmp
EXPOSE 9090 8080 8000
ENTRYPOINT ["elastune"]
CMD ["operator"]
