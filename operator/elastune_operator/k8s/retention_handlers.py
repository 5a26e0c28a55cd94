"""kopf delete handlers that reclaim what a TuningJob or LoRAAdapter owns (k8s/retention.py).

Registered after handlers.py's own delete handlers (imported at its end), so a job's attempt is cancelled,
and an adapter unloaded, before its files go. Each call is one level-triggered step, safe to repeat:

1. the plan (targets, owner uid, Secret, image) is recorded on the resource in an annotation, before
   anything is deleted: a restarted operator, or one whose WarmPool went meanwhile, reuses it;
2. the cleanup Job is created if absent (named after the resource's uid, so never twice);
3. its outcome is read: Complete → done (a Normal event names what was removed); Failed, or the Job not
   finished within ELASTUNE_RECLAIM_TIMEOUT seconds of the first try (default 600) → a Warning event
   names what was left and the handler returns, so kopf removes the finalizer: a cleanup that cannot
   run never blocks a deletion for good. Otherwise kopf calls again in a few seconds.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_contract.api.constants import (
    GROUP,
    KIND_LORA_ADAPTER,
    KIND_TUNING_JOB,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.vocabulary import Reason
from elastune_operator.k8s import retention
from elastune_operator.k8s.handlers import _counted, _plain, _runtime
from elastune_operator.k8s.runtime import Runtime

log = logging.getLogger("elastune.retention")
TIMEOUT_ENV = "ELASTUNE_RECLAIM_TIMEOUT"
POLL_S = 1.0


def _timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV) or 600)


def _pool(rt: Runtime, ns: str, model: str) -> WarmPool | None:
    """The WarmPool of ``model`` in ``ns`` (where the resource's claims are), if any."""
    listed: Any = rt.api.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL_WARM_POOLS)
    items: list[dict[str, Any]] = listed.get("items") or []
    for item in sorted(items, key=lambda i: i["metadata"].get("creationTimestamp") or ""):
        if (item.get("spec") or {}).get("model") == model:
            try:
                return WarmPool.model_validate(item)
            except ValueError:
                continue
    return None


def _reclaim(rt: Runtime, kind: str, plural: str, body: dict[str, Any], elapsed: timedelta) -> None:
    meta = body.get("metadata") or {}
    ns, name, uid = meta.get("namespace") or "default", meta.get("name") or "", meta.get("uid") or ""
    plan = retention.Plan.recorded(meta.get("annotations"))
    if plan is None:
        if kind == KIND_TUNING_JOB:
            job = TuningJob.model_validate(body)
            plan = retention.tuning_job_plan(job, _pool(rt, ns, job.spec.model))
        else:
            adapter = LoRAAdapter.model_validate(body)
            plan = retention.adapter_plan(adapter, _pool(rt, ns, adapter.spec.base_model))
        if not plan.targets:
            return  # nothing of ours to remove: retained, or never written where a pod outlives
        # Intent before effect: the plan is stored on the resource before any Job deletes anything.
        patch = {"metadata": {"annotations": {retention.PLAN_ANNOTATION: plan.to_json()}}}
        rt.api.patch_namespaced_custom_object(GROUP, VERSION, ns, plural, name, patch)
    if not plan.targets:
        return
    what = ", ".join(plan.targets)
    batch = client.BatchV1Api(rt.api.api_client)
    found = _read_job(batch, ns, plan.job)
    if found is None:
        manifest = retention.job_manifest(plan, kind, {"namespace": ns, "name": name, "uid": uid})
        batch.create_namespaced_job(ns, batch.api_client.sanitize_for_serialization(manifest))
        log.info("%s %s/%s deleted: Job %s removes %s", kind, ns, name, plan.job, what)
    outcome = retention.finished(found or {})
    if outcome == "Complete":
        rt._event(
            ns,
            name,
            kind,
            Reason.STORAGE_RECLAIMED,
            f"Job {plan.job} removed what of this it owned: {what}",
            False,
            uid,
        )
        return
    if outcome == "Failed" or elapsed.total_seconds() >= _timeout():
        why = "failed" if outcome == "Failed" else f"did not finish within {_timeout():g} s"
        message = f"cleanup Job {plan.job} {why}; what it owned may be left (delete by hand): {what}"
        rt._event(ns, name, kind, Reason.STORAGE_LEFT, message, True, uid)
        log.warning("%s %s/%s: %s", kind, ns, name, message)
        return
    raise kopf.TemporaryError(f"cleanup Job {plan.job} is removing {what}", delay=POLL_S)


def _read_job(batch: client.BatchV1Api, ns: str, name: str) -> dict[str, Any] | None:
    try:
        resp: Any = batch.read_namespaced_job(name, ns, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    job: dict[str, Any] = json.loads(resp.data)
    return job


def _step(kind: str, plural: str, body: kopf.Body, memo: kopf.Memo, elapsed: timedelta) -> None:
    rt = _runtime(memo)
    try:
        _counted(rt, f"{plural}_reclaim", _reclaim, rt, kind, plural, _plain(body), elapsed)
    except ApiException as exc:
        if elapsed.total_seconds() >= _timeout():
            meta = _plain(body).get("metadata") or {}
            message = f"cleanup not started ({exc.status} {exc.reason}); its files are left in storage"
            rt._event(
                str(meta.get("namespace") or "default"),
                str(meta.get("name") or ""),
                kind,
                Reason.STORAGE_LEFT,
                message,
                True,
                meta.get("uid") or "",
            )
            return
        raise kopf.TemporaryError(f"cleanup: {exc.status} {exc.reason}", delay=POLL_S) from exc


@kopf.on.delete(GROUP, VERSION, PLURAL_TUNING_JOBS)
def tuning_job_storage(body: kopf.Body, memo: kopf.Memo, runtime: timedelta, **_: Any) -> None:
    _step(KIND_TUNING_JOB, PLURAL_TUNING_JOBS, body, memo, runtime)


@kopf.on.delete(GROUP, VERSION, PLURAL_LORA_ADAPTERS)
def lora_adapter_storage(body: kopf.Body, memo: kopf.Memo, runtime: timedelta, **_: Any) -> None:
    _step(KIND_LORA_ADAPTER, PLURAL_LORA_ADAPTERS, body, memo, runtime)
