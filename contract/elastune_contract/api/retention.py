"""What a resource's deletion does to the storage it wrote (spec.retention).

Named after what platform teams already set: a PersistentVolume's ``persistentVolumeReclaimPolicy``
(Delete | Retain) and a StatefulSet's ``persistentVolumeClaimRetentionPolicy.whenDeleted``. The operator
deletes only what Elastune itself wrote for that resource: a location carries an owner marker written
when the worker first wrote there (namespace and uid of the TuningJob); anything without a matching
marker (a user's own artifact, another job's files) is never deleted, whatever the policy says.
"""

from typing import Literal

from elastune_contract.api.common import ApiModel

ReclaimPolicy = Literal["Delete", "Retain"]


class JobRetention(ApiModel):
    """What deleting the TuningJob removes."""

    checkpoints: ReclaimPolicy = "Delete"
    """Delete: its checkpoints and the staging copy of an s3:// artifact go with the job (they only serve
    a retry of this job). Retain: they stay, e.g. to inspect a failed run."""
    artifact: ReclaimPolicy = "Retain"
    """The tuned prompt the job produced (status.artifactURI). Retain by default: the artifact is the
    job's product, often served by a LoRAAdapter or copied elsewhere long after the job record is cleaned
    up (as KServe and AIBrix never delete the model storage a resource names). Delete: removed with the
    job when Elastune wrote it for this job."""


class AdapterRetention(ApiModel):
    """What deleting the LoRAAdapter removes."""

    artifact: ReclaimPolicy = "Retain"
    """Delete: the artifact at artifactURL is removed with the adapter, but only when a TuningJob of this
    namespace wrote it and published this adapter (its owner marker names that job); an adapter that
    registers a user's own artifact never deletes it. Retain (default): the artifact stays."""
