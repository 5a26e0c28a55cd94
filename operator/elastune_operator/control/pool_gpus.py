"""Whether a WarmPool's worker pods would use the GPUs they ask for (issue 42: gpusPerPod > 1 is used or
refused, never silently ignored).

A worker of Elastune's engine is one process on one GPU: serving has no tensor parallelism and tuning is
data parallel across pods (the storage-channel all-reduce), never across a pod's GPUs; the scheduler
counts a pod as one GPU too. So a pool asking for more per pod is refused with a reason at admission,
here as in the CRD's CEL rule, which a pool stored under an older CRD never met.
"""

from __future__ import annotations

from elastune_contract.api.warmpool import ENGINE_GPUS_PER_POD, GPUS_PER_POD_REFUSAL, WarmPoolSpec


def refusal(spec: WarmPoolSpec) -> str | None:
    """Why the pool is refused for its GPUs per pod (a condition message), or None when it is not."""
    if spec.gpus_per_pod <= ENGINE_GPUS_PER_POD:
        return None
    return (
        f"gpusPerPod is {spec.gpus_per_pod}, but {GPUS_PER_POD_REFUSAL}. Set gpusPerPod to "
        f"{ENGINE_GPUS_PER_POD} and raise maxWarmGPUs to use more GPUs (one pod each)"
    )
