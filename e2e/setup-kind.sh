#!/usr/bin/env bash
# A kind cluster with Knative Serving (+ Kourier) and Elastune installed, CPU workers only.
#
# Needs docker, kind, curl and network access to GitHub releases and ghcr.io/docker.io. Not run in CI
# (no container engine there); see e2e/README.md. Re-running it upgrades the release in place.
#
#   e2e/setup-kind.sh                    # cluster "elastune-e2e", kubeconfig in e2e/.kubeconfig
#   KNATIVE_VERSION=1.20.0 e2e/setup-kind.sh
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="${CLUSTER:-elastune-e2e}"
KNATIVE_VERSION="${KNATIVE_VERSION:-1.19.0}"
export KUBECONFIG="${KUBECONFIG_OUT:-$PWD/e2e/.kubeconfig}"
NAMESPACE="${NAMESPACE:-default}"   # where manifests/warmpool.yaml expects the Secret elastune-redis
FAKE_GPUS="${FAKE_GPUS:-4}"
OPERATOR_IMAGE=ghcr.io/elastune/operator:0.1.0
WORKER_IMAGE=ghcr.io/elastune/worker:0.1.0
HELM="${HELM:-$(python3 tools/k8s_binaries.py helm)}"
KUBECTL="${KUBECTL:-$(python3 tools/k8s_binaries.py kubectl)}"
k() { "$KUBECTL" "$@"; }

for tool in docker kind curl; do
  command -v "$tool" >/dev/null || { echo "error: $tool is required" >&2; exit 1; }
done

echo "== kind cluster $CLUSTER"
if ! kind get clusters | grep -qx "$CLUSTER"; then
  # One node: kind drops the control-plane taint then, so Knative and the workers share it.
  kind create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG" --wait 120s
fi
NODE="$CLUSTER-control-plane"
# The cold GPU pool of DESIGN.md §5: label the node, and advertise fake nvidia.com/gpu capacity so
# worker pods that request a GPU schedule; they run on the CPU (the worker falls back when CUDA is absent).
k label node "$NODE" elastune.dev/pool=cold --overwrite
k patch node "$NODE" --subresource=status --type=json \
  -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$FAKE_GPUS\"}]"

echo "== Knative Serving $KNATIVE_VERSION + Kourier"
base="https://github.com/knative/serving/releases/download/knative-v$KNATIVE_VERSION"
k apply -f "$base/serving-crds.yaml"
k wait --for=condition=Established --timeout=120s crd/services.serving.knative.dev
k apply -f "$base/serving-core.yaml"
k apply -f "https://github.com/knative/net-kourier/releases/download/knative-v$KNATIVE_VERSION/kourier.yaml"
k patch configmap/config-network -n knative-serving --type merge \
  -p '{"data":{"ingress-class":"kourier.ingress.networking.knative.dev"}}'
k patch configmap/config-domain -n knative-serving --type merge -p '{"data":{"example.com":""}}'
# WarmPools carry nodeSelector/tolerations/affinity and the operator may use fieldRef env vars;
# Knative rejects those pod-spec fields unless the features are on.
k patch configmap/config-features -n knative-serving --type merge -p '{"data":{
  "kubernetes.podspec-nodeselector":"enabled","kubernetes.podspec-tolerations":"enabled",
  "kubernetes.podspec-affinity":"enabled","kubernetes.podspec-fieldref":"enabled",
  "kubernetes.podspec-persistent-volume-claim":"enabled","kubernetes.podspec-persistent-volume-write":"enabled"}}'
# min-scale 0 with initial-scale 0: an empty warm pool starts no pod.
k patch configmap/config-autoscaler -n knative-serving --type merge \
  -p '{"data":{"allow-zero-initial-scale":"true"}}'
# The images below are loaded into kind, not pushed: Knative must not resolve their tags to digests.
k patch configmap/config-deployment -n knative-serving --type merge \
  -p '{"data":{"registries-skipping-tag-resolving":"kind.local,ko.local,dev.local,ghcr.io"}}'
k wait --for=condition=Available --timeout=300s -n knative-serving deployment --all
k wait --for=condition=Available --timeout=300s -n kourier-system deployment --all

echo "== images (CPU torch for the worker)"
docker build -f docker/operator.Dockerfile -t "$OPERATOR_IMAGE" .
docker build -f docker/worker.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu \
  -t "$WORKER_IMAGE" .
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$WORKER_IMAGE"

echo "== the claim the example WarmPools keep checkpoints and tuned prompts on (jobStorage)"
# ReadWriteMany on a real cluster; kind's local-path class only has ReadWriteOnce, enough on one node.
k apply -f - <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: elastune-artifacts, namespace: $NAMESPACE}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}
EOF

echo "== Elastune chart"
"$HELM" upgrade --install elastune helm/elastune --namespace "$NAMESPACE" --create-namespace \
  --wait --timeout 5m -f e2e/values-kind.yaml
k -n "$NAMESPACE" rollout status deployment/elastune-operator --timeout=120s

echo
echo "Ready. Run the end-to-end test with:"
echo "  ELASTUNE_E2E_KUBECONFIG=$KUBECONFIG python3 -m pytest e2e -v"
