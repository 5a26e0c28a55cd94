"""The Job controller of the pod world: batch/v1 Jobs run to completion as Kubernetes runs them.

Rules followed from kubernetes pkg/controller/job/job_controller.go (syncJob, manageJob,
pastBackoffLimitOnFailure) and the batch/v1 API reference:

- a Job without a finished condition keeps ``parallelism`` (default 1) active pods of its template,
  named ``<job>-<random>``, owned by it and labelled ``batch.kubernetes.io/job-name``, ``job-name``,
  ``batch.kubernetes.io/controller-uid`` and ``controller-uid``;
- pods that end are counted in ``status.succeeded`` / ``status.failed`` (phase Succeeded / Failed;
  the template must say restartPolicy Never or OnFailure, as the apiserver requires);
- ``completions`` (default 1) succeeded pods: condition ``Complete`` True, ``completionTime``;
- more failed pods than ``backoffLimit`` (default 6): condition ``Failed`` True with reason
  ``BackoffLimitExceeded``, active pods deleted, no new pod;
- a finished Job is never touched again. Not emulated: the exponential back-off between retries
  (retried at once here), activeDeadlineSeconds, indexed completion, pod failure policies.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from elastune_testing.podworld.controllers import _Controller, _raw

FINISHED = ("Complete", "Failed")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Jobs(_Controller):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.batch = client.BatchV1Api(self.api)

    def round(self) -> None:
        for job in _raw(self.batch.list_job_for_all_namespaces(_preload_content=False))["items"]:
            job.setdefault("apiVersion", "batch/v1")
            job.setdefault("kind", "Job")
            self._sync(job)

    def _sync(self, job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        if any(
            c.get("type") in FINISHED and c.get("status") == "True" for c in status.get("conditions") or []
        ):
            return
        meta, spec = job["metadata"], job["spec"]
        ns, name, uid = meta.get("namespace", "default"), meta["name"], meta["uid"]
        pods = self._pods(ns, uid)
        phase = lambda p: (p.get("status") or {}).get("phase")  # noqa: E731
        succeeded = sum(phase(p) == "Succeeded" for p in pods)
        failed = sum(phase(p) == "Failed" for p in pods)
        active = [p for p in pods if phase(p) not in ("Succeeded", "Failed")]
        completions = int(spec.get("completions") or 1)
        backoff = int(spec.get("backoffLimit", 6))
        new: dict[str, Any] = {"active": len(active), "succeeded": succeeded, "failed": failed}
        new.setdefault("startTime", status.get("startTime") or _now())
        if succeeded >= completions:
            new["completionTime"] = _now()
            new["conditions"] = [self._condition("Complete", "", "")]
        elif failed > backoff:
            for p in active:
                self._delete_pod(p)
            new["active"] = 0
            new["conditions"] = [
                self._condition(
                    "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
                )
            ]
        else:
            parallelism = int(spec.get("parallelism", 1))
            want = min(parallelism, completions - succeeded) - len(active)
            labels = {
                "batch.kubernetes.io/job-name": name,
                "job-name": name,
                "batch.kubernetes.io/controller-uid": uid,
                "controller-uid": uid,
            }
            for _ in range(max(0, want)):
                self._create_pod(job, f"{name}-{secrets.token_hex(3)}", spec["template"], labels)
        if {k: status.get(k) for k in new} != new:
            self.batch.patch_namespaced_job_status(name, ns, {"status": new})

    @staticmethod
    def _condition(type_: str, reason: str, message: str) -> dict[str, str]:
        now = _now()
        return {"type": type_, "status": "True", "reason": reason, "message": message,
                "lastProbeTime": now, "lastTransitionTime": now}  # fmt: skip
