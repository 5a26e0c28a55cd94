"""Names of the Elastune API, defined once and imported everywhere (docs/design.md §3, §7)."""

from typing import Final

GROUP: Final = "elastune.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "elastune.dev/v1alpha1"
assert f"{GROUP}/{VERSION}" == API_VERSION  # spelled out so type checkers see the literal

KIND_TUNING_JOB: Final = "TuningJob"
KIND_WARM_POOL: Final = "WarmPool"
KIND_LORA_ADAPTER: Final = "LoRAAdapter"
KINDS: Final = (KIND_TUNING_JOB, KIND_WARM_POOL, KIND_LORA_ADAPTER)

PLURAL_TUNING_JOBS: Final = "tuningjobs"
PLURAL_WARM_POOLS: Final = "warmpools"
PLURAL_LORA_ADAPTERS: Final = "loraadapters"
PLURALS: Final = {
    KIND_TUNING_JOB: PLURAL_TUNING_JOBS,
    KIND_WARM_POOL: PLURAL_WARM_POOLS,
    KIND_LORA_ADAPTER: PLURAL_LORA_ADAPTERS,
}
SINGULARS: Final = {kind: kind.lower() for kind in KINDS}
SHORT_NAMES: Final = {
    KIND_TUNING_JOB: ("tj",),
    KIND_WARM_POOL: ("wp",),
    KIND_LORA_ADAPTER: ("lora",),
}
# `kubectl get elastune` lists every Elastune resource.
CATEGORIES: Final = ("elastune",)

FINALIZER: Final = f"{GROUP}/finalizer"

# Label keys. The pool label is also what the GPU nodes of the cold pool carry (docs/design.md §5).
LABEL_POOL: Final = f"{GROUP}/pool"
LABEL_MODEL: Final = f"{GROUP}/model"
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_WARM_POOL: Final = f"{GROUP}/warmpool"
LABEL_ADAPTER: Final = f"{GROUP}/adapter"
# Value of LABEL_POOL on GPU nodes that have nothing loaded yet.
POOL_COLD: Final = "cold"

# Where a WarmPool's PersistentVolumeClaims are mounted in worker pods unless mountPath says otherwise:
# pvc://<claim>/<path> resolves to $ELASTUNE_PVC_ROOT/<claim>/<path>.
PVC_ROOT_ENV: Final = "ELASTUNE_PVC_ROOT"
DEFAULT_PVC_ROOT: Final = "/mnt/pvc"

# s3:// artifacts: the Secret a resource names (spec.artifactSecret, spec.output.secretName) is mounted
# read-only into the pool's worker pods at $ELASTUNE_S3_SECRETS_ROOT/<secret>/ (one file per key:
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION). The
# operator never reads it: only the Secret's name travels (placement, assignment spec).
S3_SECRETS_ROOT_ENV: Final = "ELASTUNE_S3_SECRETS_ROOT"
DEFAULT_S3_SECRETS_ROOT: Final = "/var/run/elastune/s3"
# Where workers cache downloaded s3:// artifacts (default: <tmp>/elastune-s3-cache).
S3_CACHE_ENV: Final = "ELASTUNE_S3_CACHE"
# What travels in a Secret's place when a resource sets useAmbientCredentials: the pod's own credential
# chain (AWS_* environment, instance profile, IRSA). Not a Secret name (those are DNS subdomains), so it
# can never be mistaken for one; with neither, the workers refuse s3:// instead of falling back.
AMBIENT_CREDENTIALS: Final = "@ambient"


def s3_credentials(secret: str | None, ambient: bool | None) -> str | None:
    """Where an s3:// transfer takes its credentials from, as the workers are told: the Secret's name,
    AMBIENT_CREDENTIALS, or None (neither was set: the transfer is refused)."""
    return secret or (AMBIENT_CREDENTIALS if ambient else None)
