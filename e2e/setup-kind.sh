#!/usr/bin/env bash
# A kind cluster with Elastune installed, CPU workers only. No Knative: each WarmPool's workers are an
# apps/v1 Deployment (docs/operations/warm-pool-workload.md).
#
# Needs docker, kind and network access to docker.io and download.pytorch.org. Not run in CI (no
# container engine there); see e2e/README.md. Re-running it upgrades the release in place.
#
#   e2e/setup-kind.sh                    # cluster "elastune-e2e", kubeconfig in e2e/.kubeconfig
#   FAKE_GPUS=2 e2e/setup-kind.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${CLUSTER:-elastune-e2e}"
export KUBECONFIG="${KUBECONFIG_OUT:-$PWD/e2e/.kubeconfig}"
NAMESPACE="${NAMESPACE:-default}"   # where manifests/warmpool.yaml expects the Secret elastune-redis
FAKE_GPUS="${FAKE_GPUS:-4}"
OPERATOR_IMAGE=ghcr.io/elastune/operator:0.1.0
WORKER_IMAGE=ghcr.io/elastune/worker:0.1.0
HELM="${HELM:-$(python3 tools/k8s_binaries.py helm)}"
KUBECTL="${KUBECTL:-$(python3 tools/k8s_binaries.py kubectl)}"
k() { "$KUBECTL" "$@"; }

for tool in docker kind; do
  command -v "$tool" >/dev/null || { echo "error: $tool is required" >&2; exit 1; }
done

echo "== kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
  # One node: kind drops the control-plane taint then, so the chart's pods and the workers share it.
  kind create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG" --wait 120s
fi
NODE="$CLUSTER-control-plane"
# The cold GPU pool of docs/design.md §5: label the node (the chart's operator.coldPool.nodeSelector), and
# advertise fake nvidia.com/gpu capacity ("Advertise Extended Resources for a Node" in the Kubernetes
# docs) so worker pods that request a GPU schedule; they run on the CPU (the worker falls back when CUDA
# is absent). The operator's cold pool is the allocatable GPUs of the labelled nodes
# (docs/concepts/capacity.md): wait until the node reports them.
k label node "$NODE" elastune.dev/pool=cold --overwrite
k patch node "$NODE" --subresource=status --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$FAKE_GPUS\"}]"
for _ in $(seq 60); do
  [ "$(k get node "$NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" = "$FAKE_GPUS" ] && break
  sleep 2
done
[ "$(k get node "$NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" = "$FAKE_GPUS" ] \
  || { echo "error: node $NODE does not report $FAKE_GPUS allocatable nvidia.com/gpu" >&2; exit 1; }

echo "== images (CPU torch for the worker)"
docker build -f docker/operator.Dockerfile -t "$OPERATOR_IMAGE" .
docker build -f docker/worker.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
  -t "$WORKER_IMAGE" .
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$WORKER_IMAGE"

echo "== Elastune chart"
# The chart creates the claim the example WarmPools keep checkpoints and tuned prompts on
# (elastune-artifacts, their jobStorage volume) in $NAMESPACE, as the documented install does. No
# --wait: Helm's wait needs every claim Bound (pkg/kube/ready.go volumeReady), and kind's local-path
# class binds a claim only once a pod uses it (WaitForFirstConsumer); the Deployments are waited for
# below instead.
"$HELM" upgrade --install elastune helm/elastune --namespace "$NAMESPACE" --create-namespace \
  -f e2e/values-kind.yaml --set "storage.namespaces={$NAMESPACE}"
for deployment in elastune-redis elastune-operator elastune-gateway; do
  k -n "$NAMESPACE" rollout status "deployment/$deployment" --timeout=300s
done

echo
echo "Ready. Run the end-to-end test with:"
echo "  ELASTUNE_E2E_KUBECONFIG=$KUBECONFIG python3 -m pytest e2e -v"
