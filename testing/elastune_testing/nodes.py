"""Emulated GPU nodes of the cold pool: Node objects in the API emulator, written as a kubelet writes its
own (the Node first, then its status through the status subresource: allocatable and a Ready
condition), so the operator's cold pool (elastune_operator.k8s.node_capacity) has something to count.

Only the API objects: what runs where is the pod world's kubelet's business (podworld/kubelet.py)."""

from __future__ import annotations

from kubernetes import client

from elastune_contract.api.constants import LABEL_POOL, POOL_COLD

GPU = "nvidia.com/gpu"
COLD_LABELS = {LABEL_POOL: POOL_COLD}


def add_gpu_node(
    api: client.ApiClient, name: str, gpus: int, labels: dict[str, str] | None = None, ready: bool = True
) -> None:
    """Register node ``name`` with ``gpus`` allocatable GPUs, labelled for the cold pool by default."""
    core = client.CoreV1Api(api)
    labels = COLD_LABELS if labels is None else labels
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    status = {
        "capacity": {GPU: str(gpus), "cpu": "16", "memory": "64Gi", "pods": "110"},
        "allocatable": {GPU: str(gpus), "cpu": "16", "memory": "64Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}],
    }
    core.patch_node_status(name, {"status": status})


def remove_node(api: client.ApiClient, name: str) -> None:
    client.CoreV1Api(api).delete_node(name)
