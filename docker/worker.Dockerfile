# syntax=docker/dockerfile:1
# Not built or tested here: the development machines and CI have no container engine. Build from the
# repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/elastune/worker:0.1.0 .                  # CUDA
#   docker build -f docker/worker.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
#     -t ghcr.io/elastune/worker:0.1.0-cpu .                                                    # CPU (kind e2e)
#
# The data plane: one pod = one GPU, HTTP on $PORT (Knative) with /healthz, /readyz; /metrics on
# $ELASTUNE_METRICS_PORT.
#
# torch: installed on its own, first, pinned (as .ci/run does), so resolving the `worker` extra never
# swaps it. The default index serves CUDA builds (the image is then several GB and needs the NVIDIA
# container runtime on the node); TORCH_INDEX=https://download.pytorch.org/whl/cpu gives a ~1 GB
# CPU-only image for clusters without GPUs.

FROM python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ELASTUNE_CACHE=/opt/elastune/cache \
    OMP_WAIT_POLICY=PASSIVE
RUN if [ -n "$TORCH_INDEX" ]; then \
      pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    else \
      pip install "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY contract/ contract/
COPY common/ common/
COPY operator/ operator/
COPY worker/ worker/
COPY testing/ testing/
# The benchmarks (`elastune bench`, found by entry point; no product process imports them).
COPY bench/ bench/
# SSJF's output-length predictor service runs from this image too (command: python -m elastune_ssjf).
COPY ssjf/ ssjf/
# The `elastune` command (elastune_cli: `elastune bench`, `elastune bank`, ...).
COPY cli/ cli/
# demo/ is not copied here: the worker package never imports it (it finds demo models by entry point).
RUN pip install ".[worker]" && rm -rf /src
# Relative dataset paths in a TuningJob resolve against the worker's working directory: the example
# datasets of manifests/data/ live in /app/data, so manifests/tuningjob.yaml (data/extract.jsonl)
# runs unchanged on a cluster.
WORKDIR /app
COPY manifests/data/ data/

# ---- Demo fixtures (elastune_demo): a separate step, not part of the worker package ----------------------
# Kept for a zero-setup first run: the quick start's WarmPool (model tiny-gpt2) and the e2e LoRAAdapters
# work with no model download and no storage to set up. The trade-off: about 10 MB of self-made models and
# adapters, the demo code and a few minutes of build in an image whose production pools name real models.
# For a production-only image delete this block: a pool that names a demo model then fails to load with a
# message saying to install elastune_demo or name a real model (elastune_worker/server/models.py).
# The tiny GPT-2 and Llama and the Llama's LoRA adapters (ranks 8-64) are built into $ELASTUNE_CACHE, so
# pods start warm from local files and never reach a model hub (HF_HUB_OFFLINE below); the adapters are
# linked as /app/adapters/<name> (LoRAAdapter artifactURLs in e2e/). The worker resolves the demo names
# through the distribution's `elastune.models` entry points, which load elastune_demo from PYTHONPATH.
COPY demo/ /opt/elastune/demo/
ENV PYTHONPATH=/opt/elastune/demo
RUN python -m elastune_demo.build \
 && python -m elastune_demo.build --arch llama \
 && python -m elastune_demo.adapters --link-into /app/adapters
# ---- end of the demo fixtures ------------------------------------------------------------------------

RUN groupadd --system --gid 10001 elastune \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --shell /usr/sbin/nologin elastune \
 && chmod -R a+rX /opt/elastune /app
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=/tmp/hf HOME=/tmp
USER 10001:10001
# Knative sets PORT (8080 by default). /metrics is on a port of its own (the serving one answers 404).
ENV PORT=8080 ELASTUNE_METRICS_PORT=9091
EXPOSE 8080 9091
ENTRYPOINT ["python", "-m", "elastune_worker"]
CMD ["serve"]
