"""The status vocabulary, defined once: condition types, reasons and which failures are permanent.

Kubernetes API conventions (kubebuilder's conditions.go, crate's constants.py): reasons are CamelCase
constants that tools and alerts match on, so every producer — the control core, the kopf runtime,
local mode, the worker agent, the datasets code, the Prompt Bank — imports them from here and none
writes its own literal. tests/contract/test_vocabulary.py fails when code passes a reason literal instead.
"""

from __future__ import annotations

from typing import Final


class ConditionType:
    """Condition types. Succeeded (TuningJob) and Ready (WarmPool, LoRAAdapter) are the summaries."""

    ACCEPTED: Final = "Accepted"
    SCHEDULED: Final = "Scheduled"
    RUNNING: Final = "Running"
    SUCCEEDED: Final = "Succeeded"
    FAILED: Final = "Failed"
    READY: Final = "Ready"
    LOADED: Final = "Loaded"
    MODEL_READY: Final = "ModelReady"
    """WarmPool: whether its hf://, s3:// or pvc:// model is in the cache (False: why not; the workers
    start only once it is True)."""
    PUBLISHED: Final = "Published"
    """TuningJob: whether output.publish became a LoRAAdapter (False: why not, e.g. PublishNameTaken)."""


class Reason:
    """CamelCase reasons of conditions, events and Prompt Bank outcomes."""

    # Accepted
    VALIDATED: Final = "Validated"
    INVALID_SPEC: Final = "InvalidSpec"
    UNKNOWN_MODEL: Final = "UnknownModel"
    # Kubernetes: the job's output (or checkpoints) could only land in a pod's ephemeral storage.
    OUTPUT_NOT_DURABLE: Final = "OutputNotDurable"
    SPEC_CHANGE_IGNORED: Final = "SpecChangeIgnored"
    # Scheduled
    PENDING: Final = "Pending"
    # Tenancy: the only WarmPool of the job's or adapter's model is in another namespace and its
    # spec.allowedNamespaces does not list this one (the job waits; the adapter is not served)
    POOL_NOT_SHARED: Final = "PoolNotShared"
    # Tenancy: a job or adapter that runs on another namespace's WarmPool (a borrower) names that
    # namespace's claims, Secrets, pod paths or cloud identity; sharing lends GPUs only
    FOREIGN_REFERENCE: Final = "ForeignReference"
    POOL_GROWING: Final = "PoolGrowing"
    WARM_GPUS_ASSIGNED: Final = "WarmGPUsAssigned"
    RESCHEDULING: Final = "Rescheduling"
    # Running and how a run ends
    TUNING: Final = "Tuning"
    TARGET_REACHED: Final = "TargetReached"
    MAX_ITERATIONS: Final = "MaxIterations"
    COMPLETED: Final = "Completed"
    CANCELLED: Final = "Cancelled"
    # Failures a retry from the checkpoint may fix
    WORKER_LOST: Final = "WorkerLost"
    ATTEMPT_LOST: Final = "AttemptLost"
    # An attempt that ran past one of its timeouts (control.attempt_timeouts): cancelled and retried
    ATTEMPT_NOT_STARTED: Final = "AttemptNotStarted"
    ATTEMPT_STALLED: Final = "AttemptStalled"
    RESULT_LOST: Final = "ResultLost"
    COLLECTIVE_TIMEOUT: Final = "CollectiveTimeout"
    # Failures no retry fixes (see PERMANENT_FAILURE_REASONS)
    DATASET_NOT_FOUND: Final = "DatasetNotFound"
    DATASET_MALFORMED: Final = "DatasetMalformed"
    DATASET_EMPTY: Final = "DatasetEmpty"
    DATASET_UNSUPPORTED_SCHEME: Final = "DatasetUnsupportedScheme"
    INVALID_ASSIGNMENT: Final = "InvalidAssignment"
    CHECKPOINT_MISMATCH: Final = "CheckpointMismatch"
    CHANNEL_UNREACHABLE: Final = "ChannelUnreachable"
    MODEL_LOAD_FAILED: Final = "ModelLoadFailed"
    WORKER_ERROR: Final = "WorkerError"
    WORKER_START_FAILED: Final = "WorkerStartFailed"
    WARM_POOL_DELETED: Final = "WarmPoolDeleted"
    # A TuningJob asks for more than its WarmPool's spec.jobLimits allow
    EXCEEDS_POOL_LIMITS: Final = "ExceedsPoolLimits"
    # A worker pod that will not become or stay a worker, named as its status names it (the kubelet's
    # waiting/termination reasons, the scheduler's Unschedulable); the attempt is retried like a lost
    # worker, up to the core's max_attempts
    IMAGE_PULL_BACK_OFF: Final = "ImagePullBackOff"
    INVALID_IMAGE_NAME: Final = "InvalidImageName"
    CREATE_CONTAINER_CONFIG_ERROR: Final = "CreateContainerConfigError"
    CREATE_CONTAINER_ERROR: Final = "CreateContainerError"
    CRASH_LOOP_BACK_OFF: Final = "CrashLoopBackOff"
    OOM_KILLED: Final = "OOMKilled"
    UNSCHEDULABLE: Final = "Unschedulable"
    POD_FAILED: Final = "PodFailed"
    # LoRAAdapter Ready / Loaded (and what a TuningJob's output.publish did)
    SERVABLE: Final = "Servable"
    ARTIFACT_NOT_FOUND: Final = "ArtifactNotFound"
    NOT_A_PEFT_ADAPTER: Final = "NotAPEFTAdapter"
    ARTIFACT_MISMATCH: Final = "ArtifactMismatch"
    ARTIFACT_UNSUPPORTED_SCHEME: Final = "ArtifactUnsupportedScheme"
    # s3:// artifact storage (a TuningJob's output upload or an adapter's download, by the worker)
    STORAGE_BUCKET_NOT_FOUND: Final = "StorageBucketNotFound"
    STORAGE_ACCESS_DENIED: Final = "StorageAccessDenied"
    STORAGE_SECRET_NOT_FOUND: Final = "StorageSecretNotFound"
    STORAGE_UNREACHABLE: Final = "StorageUnreachable"
    # s3:// with neither a Secret nor useAmbientCredentials: never the pod's identity by default
    STORAGE_CREDENTIALS_UNSET: Final = "StorageCredentialsUnset"
    # The output location is marked as written by another namespace's job, or holds unmarked objects:
    # a job never replaces what it did not write
    OUTPUT_NOT_OURS: Final = "OutputNotOurs"
    RANK_ABOVE_MAXIMUM: Final = "RankAboveMaximum"
    NAME_CLASHES_WITH_MODEL: Final = "NameClashesWithModel"
    # WarmPool Ready: configured, or refused because another WarmPool of its namespace serves its model
    POOL_CONFIGURED: Final = "Configured"
    DUPLICATE_WARM_POOL: Final = "DuplicateWarmPool"
    # WarmPool Ready: refused because its Redis user cannot be created (the operator lacks ACL rights, or
    # Redis has no ACLs); its workers are never given a shared password instead
    REDIS_USER_UNAVAILABLE: Final = "RedisUserUnavailable"
    # WarmPool Ready: refused because spec.gpusPerPod asks for more GPUs than Elastune's engine uses (one a
    # pod, for serving and tuning alike); models that need several are for vLLM pools (not built yet)
    GPUS_PER_POD_UNSUPPORTED: Final = "GPUsPerPodUnsupported"
    # WarmPool Ready: its workers wrote more to Redis than the pool's budget; their user lost its write
    # rights until a new password is asked for (the rotate annotation)
    REDIS_BUDGET_EXCEEDED: Final = "RedisBudgetExceeded"
    # WarmPool ModelReady: the fetch Job's outcome (model_fetch), written by the fetcher as its
    # termination message "Reason: message" and read back by the operator
    MODEL_FETCHING: Final = "ModelFetching"
    MODEL_FETCHED: Final = "ModelFetched"
    MODEL_ACCESS_DENIED: Final = "ModelAccessDenied"
    MODEL_NOT_FOUND: Final = "ModelNotFound"
    MODEL_REVISION_NOT_FOUND: Final = "ModelRevisionNotFound"
    MODEL_UNSUPPORTED: Final = "ModelUnsupported"
    MODEL_FETCH_FAILED: Final = "ModelFetchFailed"
    ADAPTER_LOAD_FAILED: Final = "AdapterLoadFailed"
    ADAPTER_LOADED: Final = "AdapterLoaded"
    NO_WARM_POD: Final = "NoWarmPod"
    LOADING: Final = "Loading"
    PUBLISHED: Final = "Published"
    # A TuningJob's output.publish names a LoRAAdapter that exists and was not created by that job
    PUBLISH_NAME_TAKEN: Final = "PublishNameTaken"
    # Events of a TuningJob's or LoRAAdapter's deletion (spec.retention): what it owned was removed, or
    # the cleanup gave up and names what is left
    STORAGE_RECLAIMED: Final = "StorageReclaimed"
    STORAGE_LEFT: Final = "StorageLeft"
    # Prompt Bank (status.promptBank.reason): the latency budget's verdict, then the lookup's outcome
    PROMPT_BANK_USED: Final = "PromptBankUsed"
    PROMPT_BANK_REQUESTED: Final = "PromptBankRequested"
    WITHIN_LATENCY_BUDGET: Final = "WithinLatencyBudget"
    LATENCY_BUDGET_EXCEEDED: Final = "LatencyBudgetExceeded"
    PROMPT_BANK_DISABLED: Final = "PromptBankDisabled"
    PROMPT_BANK_EMPTY: Final = "EmptyBank"
    PROMPT_BANK_NO_FEATURES: Final = "NoFeatures"
    PROMPT_BANK_NO_TARGETS: Final = "NoTargets"
    # Prompt Bank insertion (a tuned prompt offered to the bank)
    PROMPT_BANK_INSERTED: Final = "Inserted"
    PROMPT_BANK_DUPLICATE: Final = "Duplicate"


#: Failures a retry cannot fix: the job ends Failed at once. Anything else (a peer lost, a collective
#: timeout) is retried from the last checkpoint, up to the core's ``max_attempts``.
PERMANENT_FAILURE_REASONS: Final = frozenset(
    {
        Reason.DATASET_NOT_FOUND,
        Reason.DATASET_MALFORMED,
        Reason.DATASET_EMPTY,
        Reason.DATASET_UNSUPPORTED_SCHEME,
        Reason.INVALID_SPEC,
        Reason.EXCEEDS_POOL_LIMITS,
        Reason.INVALID_ASSIGNMENT,
        Reason.CHECKPOINT_MISMATCH,
        Reason.CHANNEL_UNREACHABLE,
        Reason.MODEL_LOAD_FAILED,
        Reason.WORKER_ERROR,
        # The output bucket is missing or refuses these credentials: retrying the upload cannot help
        # (StorageUnreachable may be a blip, and is retried).
        Reason.STORAGE_BUCKET_NOT_FOUND,
        Reason.STORAGE_ACCESS_DENIED,
        Reason.STORAGE_SECRET_NOT_FOUND,
        Reason.STORAGE_CREDENTIALS_UNSET,
        Reason.OUTPUT_NOT_OURS,
        Reason.FOREIGN_REFERENCE,
    }
)

#: Why a model fetch failed: the reasons a fetch Job's termination message may carry.
MODEL_FETCH_FAILURE_REASONS: Final = frozenset(
    {
        Reason.MODEL_ACCESS_DENIED,
        Reason.MODEL_NOT_FOUND,
        Reason.MODEL_REVISION_NOT_FOUND,
        Reason.MODEL_UNSUPPORTED,
        Reason.MODEL_FETCH_FAILED,
    }
)

#: Prompt Bank outcomes where the lookup was skipped on purpose (metric result "skipped"); any other
#: reason without a pick is a failed lookup.
PROMPT_BANK_SKIP_REASONS: Final = frozenset({Reason.PROMPT_BANK_DISABLED, Reason.LATENCY_BUDGET_EXCEEDED})
#: Why a Prompt Bank lookup cannot serve (BankError): the job keeps its own initial prompt.
PROMPT_BANK_ERROR_REASONS: Final = (
    Reason.PROMPT_BANK_EMPTY,
    Reason.PROMPT_BANK_NO_FEATURES,
    Reason.PROMPT_BANK_NO_TARGETS,
)


def _values(cls: type) -> frozenset[str]:
    return frozenset(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))


CONDITION_TYPES: Final = _values(ConditionType)
REASONS: Final = _values(Reason)
