"""The operator's runtime: one thread owns the control core and does all its I/O (Redis, the Kubernetes
API through the sync client); kopf handlers only hand it commands. Status is written with merge
patches to the /status subresource whenever the core changes it; condition transitions are also
posted as Kubernetes Events.

Why a thread and not kopf handlers doing the work: the core runs a scheduling round every 50 ms over
all jobs and pools together (PromptTuner decides globally); per-object handlers cannot do that, and
kopf handlers must never sleep.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_common.bus import Bus
from elastune_contract.api import units
from elastune_contract.api.common import ConditionStatus, set_condition
from elastune_contract.api.constants import (
    API_VERSION,
    GROUP,
    KIND_LORA_ADAPTER,
    KIND_TUNING_JOB,
    LABEL_JOB,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.api.loraadapter import LoRAAdapter, LoRAAdapterStatus
from elastune_contract.api.resources import InvalidResource, parse_resource
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool, WarmPoolStatus
from elastune_contract.protocol import PASSWORD_ENV, adapter_id
from elastune_contract.request_credential import load_key
from elastune_contract.vocabulary import ConditionType, Reason
from elastune_operator.api_keys import namespace_models
from elastune_operator.control import borrowing, pool_gpus
from elastune_operator.control.attempt_timeouts import AttemptTimeouts
from elastune_operator.control.core import ControlCore, PublishRefused
from elastune_operator.control.lifecycle import is_terminal
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig, pool_not_shared
from elastune_operator.control.resources import (
    OutputNotDurable,
    artifact_location,
    durable_storage,
    job_record,
    pool_config,
)
from elastune_operator.control.serving import AdapterRecord, holders_of
from elastune_operator.failpoints import PUBLISH_AFTER_CREATE, failpoint
from elastune_operator.k8s import redis_budget
from elastune_operator.k8s.model_fetch import ModelFetcher
from elastune_operator.k8s.node_capacity import NodeCapacity
from elastune_operator.k8s.pod_status import PodFailureRules
from elastune_operator.k8s.redis_budget import RedisBudget
from elastune_operator.k8s.redis_users import PoolRedisUsers, RedisUserUnavailable
from elastune_operator.k8s.settings import WORKER_PASSWORD_ENV, OperatorSettings
from elastune_operator.k8s.workload import WorkloadBackend
from elastune_operator.metrics import ControlMetrics

log = logging.getLogger("elastune.operator")

POOL_STATUS_SECONDS = 1.0
USER_RETRY_S = 2.0
"""How often a WarmPool refused for its Redis user (RedisUserUnavailable) is tried again: one ACL SETUSER."""
STATUS_WRITERS = 8
#: Transitions not worth an Event (every job goes through them; status shows them anyway).
QUIET_CONDITIONS = frozenset({(ConditionType.ACCEPTED, "True"), (ConditionType.SCHEDULED, "False")})


def status_patch(job: JobRecord) -> dict[str, Any]:
    """The job's status as a merge patch: set fields as they are, unset top-level fields as null so a
    stale value (e.g. predictedCompletionTime after completion) is removed; no nulls inside lists."""
    out: dict[str, Any] = job.status.model_dump(by_alias=True, mode="json", exclude_none=True)
    for name, info in type(job.status).model_fields.items():
        out.setdefault(info.alias or name, None)
    return out


class Runtime:
    def __init__(
        self,
        settings: OperatorSettings,
        api_client: client.ApiClient,
        *,
        bus: Bus | None = None,
        metrics: ControlMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.api = client.CustomObjectsApi(api_client)
        self.events_api = client.CoreV1Api(api_client)
        self.bus = bus or Bus(settings.redis_url, settings.namespace)
        self.metrics = metrics or ControlMetrics()
        self.backend = WorkloadBackend(
            api_client,
            settings.redis_url,
            settings.redis_secret,
            settings.redis_secret_key,
            # What the workers get: the worker ACL user's password when there is one, never the operator's.
            redis_password=os.environ.get(WORKER_PASSWORD_ENV)
            or os.environ.get(PASSWORD_ENV)
            or urlsplit(settings.redis_url).password,
            redis_username=settings.redis_worker_username,
            pod_rules=PodFailureRules(unschedulable_grace_s=settings.pod_unschedulable_grace_s),
            network_policy=json.loads(settings.worker_network_policy or "null"),
            pool_users=bool(settings.redis_secret),
            request_secret=load_key(dict(os.environ)),  # the chart's request-key (request_key.py)
        )
        # A Redis with auth: each pool's workers get a user of their own (never a shared password).
        self.redis_users = (
            PoolRedisUsers(self.bus.redis, client.CoreV1Api(api_client), self.api, settings.namespace,
                           settings.redis_rotation_s)
            if settings.redis_secret else None
        )  # fmt: skip
        self._no_redis_user: dict[str, WarmPool] = {}  # "ns/name" -> refused: its Redis user failed
        self.redis_budget = (
            RedisBudget(self.bus.redis, settings.namespace, settings.redis_pool_budget_bytes,
                        self.redis_users.suspend)
            if self.redis_users is not None and settings.redis_pool_budget_bytes > 0 else None
        )  # fmt: skip
        self._next_budget_check = 0.0
        self._next_user_retry = 0.0
        core_settings = CoreSettings(
            cold_capacity=0,  # the cold pool's nodes set it (self.nodes, on start)
            channel_url=settings.channel_url or settings.redis_url,
            work_dir=settings.work_dir,
            collective_timeout_s=settings.collective_timeout_s,
            policy=settings.scheduling_policy,
            check_artifact_paths=settings.check_artifact_paths,
            **_proof_key(),
        )
        self.core = ControlCore(
            self.backend,
            self.bus,
            core_settings,
            [],
            on_status=self._on_status,
            metrics=self.metrics,
            on_adapter_status=self._on_adapter_status,
            on_publish=self._on_publish,
            persist=self._persist,
            on_move=self._on_move,
            timeouts=AttemptTimeouts(
                start_timeout_s=settings.attempt_start_timeout_s,
                stall_floor_s=settings.attempt_stall_floor_s,
            ),
        )
        self._commands: queue.Queue[tuple[Callable[[], Any], threading.Event | None, list[Any]]] = (
            queue.Queue()
        )
        self._dirty: dict[str, JobRecord] = {}
        self._adapters_dirty: dict[str, AdapterRecord] = {}
        self._posted: dict[str, set[tuple[str, str, str]]] = {}  # job key -> conditions already evented
        self._pools: dict[str, WarmPool] = {}  # "ns/name" -> resource (the pools the core runs)
        self._rejected: dict[str, WarmPool] = {}  # "ns/name" -> a WarmPool whose model has a pool in its ns
        self._unsupported: dict[str, WarmPool] = {}  # "ns/name" -> refused for its GPUs per pod (pool_gpus)
        self.models = ModelFetcher(api_client)
        self._fetching: dict[str, WarmPool] = {}  # "ns/name" -> a WarmPool whose model is not fetched yet
        self._pool_conditions: dict[str, list[Any]] = {}  # "ns/name" -> its Ready condition
        self._held: dict[str, dict[str, Any]] = {}  # job key -> body: no pool of its model admits it
        self._resources: dict[str, TuningJob] = {}  # job key -> resource, while it may move pools
        self._pool_status: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_pool_status = 0.0
        self._writers = ThreadPoolExecutor(STATUS_WRITERS, thread_name_prefix="status")
        # The cold pool is the GPUs of the selected nodes, followed as they come and go; applied in the
        # core thread, where the scheduler reads it.
        self.nodes = NodeCapacity(
            api_client,
            settings.cold_pool_node_selector,
            lambda gpus: self.call(functools.partial(self.core.state.set_capacity, gpus)),
        )

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.bus.ping()
        self.nodes.start()  # lists the nodes first: the first round plans on what is there
        self._thread = threading.Thread(target=self._loop, name="elastune-core", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.nodes.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def call(self, fn: Callable[[], Any], wait: float | None = None) -> Any:
        """Run ``fn`` in the core thread; with ``wait``, block until done and return its result."""
        done = threading.Event() if wait is not None else None
        box: list[Any] = []
        self._commands.put((fn, done, box))
        if done is not None:
            if not done.wait(wait):
                raise TimeoutError("the control core did not answer in time")
            if box and isinstance(box[0], BaseException):
                raise box[0]
            return box[0] if box else None
        return None

    def _loop(self) -> None:
        period = self.core.settings.round_seconds
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self._drain()
                self.core.tick()
                self._flush()
            except Exception:  # one bad round must not end the operator: log, count, go on
                self.metrics.handler_errors.labels("core").inc()
                log.error("control round failed:\n%s", traceback.format_exc())
            self._stop.wait(max(0.0, period - (time.monotonic() - t0)))

    def _drain(self) -> None:
        while True:
            try:
                fn, done, box = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                box.append(fn())
            except BaseException as exc:
                box.append(exc)
                if done is None:
                    log.error("command failed:\n%s", traceback.format_exc())
            finally:
                if done is not None:
                    done.set()

    # -- commands (called from kopf handlers) -------------------------------------------------------
    def upsert_pool(self, body: dict[str, Any]) -> None:
        """Configure the pool, or refuse it (Ready=False, DuplicateWarmPool) when another WarmPool of its
        namespace already serves its model (one per namespace and model): a refused pool touches nothing
        of the other one. Other namespaces' pools of the model are pools of their own (each serves its
        namespace and those it admits). Jobs held because no pool admitted their namespace are tried
        again."""
        pool = parse_resource(body)
        assert isinstance(pool, WarmPool)
        retry: list[dict[str, Any]] = self.call(functools.partial(self._apply_pool, pool), wait=30)
        for held in retry:
            self.submit_job(held)

    def _apply_pool(self, pool: WarmPool) -> list[dict[str, Any]]:
        """In the core thread: accept or refuse ``pool``; returns the held jobs of its model."""
        key = f"{pool.metadata.namespace or 'default'}/{pool.metadata.name}"
        if (why := pool_gpus.refusal(pool.spec)) is not None:
            if key in self._pools:  # a configured pool changed under an older CRD: it keeps its spec
                why += "; the pool keeps running its previous spec"
            else:  # its status is written; nothing else is made, whatever else held it back before
                self._unsupported[key] = pool
                for held_back in (self._rejected, self._fetching, self._no_redis_user):
                    held_back.pop(key, None)
            self._pool_condition(key, "False", Reason.GPUS_PER_POD_UNSUPPORTED, why)
            log.warning("WarmPool %s refused: %s", key, why)
            return []
        self._unsupported.pop(key, None)
        model, ns = pool.spec.model, pool.metadata.namespace or "default"
        owner = next(
            (
                k
                for k, p in self._pools.items()
                if k != key and p.spec.model == model and (p.metadata.namespace or "default") == ns
            ),
            None,
        )
        if owner is not None:
            self._rejected[key] = pool
            self._pool_condition(
                key,
                "False",
                Reason.DUPLICATE_WARM_POOL,
                f"namespace {ns} already has WarmPool {owner} of model {model!r}; a namespace has one "
                f"WarmPool per model. Delete this one and use {owner}, or serve another model",
            )
            log.warning("WarmPool %s refused: %s already has WarmPool %s of %s", key, ns, owner, model)
            return []
        if not self._model_ready(key, pool):  # no worker before its model is in the cache
            return []
        if not self._redis_user(key, pool):  # no worker without a Redis user of its own
            return []
        previous = self._pools.get(key)
        self._pools[key] = pool  # before the core's add_pool: jobs moving to it place their storage here
        try:
            self.core.add_pool(pool_config(pool))
        except Exception:
            if previous is None:
                del self._pools[key]
            else:
                self._pools[key] = previous
            raise
        self._rejected.pop(key, None)
        self.backend.register(pool)
        admits = ", ".join([pool.metadata.namespace or "default", *(pool.spec.allowed_namespaces or [])])
        self._pool_condition(key, "True", Reason.POOL_CONFIGURED, f"serves {model} to namespaces {admits}")
        if self.redis_users is not None and self.redis_users.suspended(pool):
            self._budget_exceeded(key)
        return [b for b in self._held.values() if (b.get("spec") or {}).get("model") == model]

    def _model_ready(self, key: str, pool: WarmPool) -> bool:
        """Whether the pool's model needs no fetch or is fetched (ModelReady=True). Otherwise its fetch
        Job runs (k8s/model_fetch.py), ModelReady and Ready say why not, and _flush_pools asks again."""
        state = self.models.state(pool)
        if state is not None:
            model_ready = (ConditionType.MODEL_READY, state.status, state.reason, state.message)
            self._pool_conditions[key] = set_condition(self._pool_conditions.get(key), *model_ready)
        if state is None or state.ready:
            self._fetching.pop(key, None)
            return True
        self._fetching[key] = pool
        message = f"workers start when the model is fetched: {state.message}"
        self._pool_condition(key, "False", state.reason, message)
        return False

    def _redis_user(self, key: str, pool: WarmPool) -> bool:
        """Whether the pool's Redis user is in place (or not needed: Redis without auth). Otherwise the
        pool is refused with the reason, and _flush_pools tries again (rights may be granted later)."""
        if self.redis_users is None:
            return True
        try:
            self.redis_users.ensure(pool)
        except RedisUserUnavailable as exc:
            self._no_redis_user[key] = pool
            self._pool_condition(key, "False", Reason.REDIS_USER_UNAVAILABLE, str(exc))
            log.warning("WarmPool %s refused: %s", key, exc)
            return False
        self._no_redis_user.pop(key, None)
        return True

    def _budget_exceeded(self, key: str) -> None:
        self._pool_condition(
            key, "False", Reason.REDIS_BUDGET_EXCEEDED,
            f"its workers wrote more than {self.settings.redis_pool_budget_bytes} bytes to Redis: their "
            "Redis user may no longer write (its largest keys were deleted); annotate the WarmPool "
            "rotate.elastune.dev/redis-password=<new value> to give them a new password with write rights",
        )  # fmt: skip

    def _pool_condition(self, key: str, status: ConditionStatus, reason: str, message: str) -> None:
        self._pool_conditions[key] = set_condition(
            self._pool_conditions.get(key), ConditionType.READY, status, reason, message
        )

    def delete_pool(self, body: dict[str, Any]) -> None:
        """Keyed by namespace/name: a refused duplicate goes without touching the pool that serves its
        model in its namespace; a configured pool's jobs not dispatched yet move to another pool that
        admits them, the others fail (WarmPoolDeleted), and a refused pool of the same namespace and
        model, if any, is configured in its place. Other namespaces' pools are never touched."""
        meta = body.get("metadata", {})
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name')}"

        def apply() -> WarmPool | None:
            self._pool_conditions.pop(key, None)
            self._pool_status.pop(key, None)
            self._forget_redis_user(key)
            if self._rejected.pop(key, None) is not None or self._fetching.pop(key, None) is not None:
                return None
            if self._no_redis_user.pop(key, None) is not None or self._unsupported.pop(key, None):
                return None
            pool = self._pools.pop(key, None)
            if pool is None:
                return None
            self.core.remove_pool(key, f"WarmPool {key} was deleted")
            self.backend.unregister(key)
            ns = pool.metadata.namespace or "default"
            return next(
                (
                    p
                    for p in self._rejected.values()
                    if p.spec.model == pool.spec.model and (p.metadata.namespace or "default") == ns
                ),
                None,
            )

        waiting = self.call(apply, wait=30)
        if waiting is not None:
            self.upsert_pool(waiting.model_dump(by_alias=True, mode="json", exclude_none=True))

    def _forget_redis_user(self, key: str) -> None:
        if self.redis_users is None:
            return
        ns, name = key.split("/", 1)
        try:
            self.redis_users.remove(ns, name)
        except Exception as exc:  # no ACL rights, Redis down: the user stays, confined to a pool's keys
            log.warning("could not delete the Redis user of WarmPool %s: %s", key, exc)

    def submit_job(self, body: dict[str, Any]) -> None:
        meta = body.get("metadata", {})
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        try:
            job = parse_resource(body)
            assert isinstance(job, TuningJob)
            artifact = artifact_location(job, str(self.settings.work_dir))
        except (InvalidResource, ValueError) as exc:
            # Passed the CRD schema but not the model (e.g. a CEL rule the apiserver did not check).
            errors = exc.errors if isinstance(exc, InvalidResource) else [str(exc)]
            self._fail_invalid(meta, "; ".join(errors))
            return
        rec = job_record(job, created=None, dataset=job.spec.dataset, artifact=artifact)
        ns = meta.get("namespace") or "default"
        if not any(p.model == job.spec.model for p in list(self.core.pools.values())):
            self._refresh_pools()  # a WarmPool applied together with the job may not be handled yet
        secret = job.spec.output.secret_name if job.spec.output else None

        def submit() -> None:
            # The job's pool, resolved once here and handed on: the s3 Secret's mount, its storage
            # and the core all use this one (a terminal job needs none).
            cfg = None if is_terminal(rec) else self.core.resolve(ns, job.spec.model)
            of_model = sorted(k for k, p in self.core.pools.items() if p.model == job.spec.model)
            if of_model and not is_terminal(rec) and cfg is None:
                self._hold(body, rec, of_model)
                return
            self._held.pop(rec.key, None)
            if cfg is not None and (foreign := borrowing.job_references(job.spec, ns, cfg.namespace)):
                # Lends GPUs only: nothing mounted or dispatched; the status is written off this thread.
                message = borrowing.refusal("TuningJob", ns, cfg.key, foreign)
                self._writers.submit(self._fail_invalid, meta, message, Reason.FOREIGN_REFERENCE)
                return
            if cfg is not None and secret:
                self.backend.use_s3_secret(cfg.key, secret)
            if self._place_storage(job, rec, cfg, meta):
                self.core.submit_to(rec, cfg)

        # Fire and forget: the core thread takes it in its next round (a round is 50 ms); blocking kopf's
        # handler threads on it would serialise a burst of creations behind the rounds.
        self.call(submit)
        log.info("submitted %s", key)

    def _hold(self, body: dict[str, Any], rec: JobRecord, pools: list[str]) -> None:
        """In the core thread: the pools of the job's model (``pools``, their ids) are other
        namespaces' and none admits the job's: it is not scheduled (Scheduled=False, PoolNotShared) and
        waits, tried again whenever a WarmPool of its model is applied."""
        ns = rec.namespace
        first = rec.key not in self._held
        self._held[rec.key] = body
        message = pool_not_shared(rec.llm, ns, pools)
        rec.status.observed_generation = rec.generation
        for ctype, status, reason, text in (
            (ConditionType.ACCEPTED, "True", Reason.VALIDATED, "spec is valid; waiting for a WarmPool"),
            (ConditionType.SCHEDULED, "False", Reason.POOL_NOT_SHARED, message),
            (ConditionType.SUCCEEDED, "Unknown", Reason.PENDING, ""),
        ):
            rec.status.conditions = set_condition(
                rec.status.conditions, ctype, status, reason, text, observed_generation=rec.generation
            )
        self._dirty[rec.key] = rec
        if first:
            name = rec.key.split("/", 1)[1]
            self._event(ns, name, KIND_TUNING_JOB, Reason.POOL_NOT_SHARED, message, True, rec.uid)

    def _place_storage(
        self, job: TuningJob, rec: JobRecord, cfg: PoolConfig | None, meta: dict[str, Any]
    ) -> bool:
        """In the core thread: the job's artifact and checkpoints on the durable claims of its pool
        ``cfg`` (``durable_storage``), or the job refused with the reason (False). Nothing in a pod's
        filesystem outlives the pod; a job that already ended keeps its status, and one whose model no
        pool serves is failed by the core (UnknownModel)."""
        pool = self._pools.get(cfg.key) if cfg else None
        if pool is None or is_terminal(rec):
            return True
        self._resources[rec.key] = job
        try:
            placed = durable_storage(job, pool)
        except ValueError as exc:
            reason = Reason.OUTPUT_NOT_DURABLE if isinstance(exc, OutputNotDurable) else Reason.INVALID_SPEC
            self._fail_invalid(meta, str(exc), reason)
            return False
        rec.artifact_dir, rec.checkpoint_root = placed.artifact, placed.checkpoints
        return True

    def _on_move(self, rec: JobRecord, cfg: PoolConfig) -> bool:
        """In the core thread: a job not dispatched yet moves to pool ``cfg`` (its own namespace's
        appeared, or its pool went): its artifact and checkpoints go on that pool's claims, or it stays
        (False) when they cannot."""
        job, pool = self._resources.get(rec.key), self._pools.get(cfg.key)
        if job is None or pool is None:
            return job is None  # no storage placed for it (terminal or not on Kubernetes storage)
        if foreign := borrowing.job_references(job.spec, rec.namespace, cfg.namespace):
            log.info("%s stays on %s: on WarmPool %s it would be a borrower (%s)", rec.key, rec.pool,
                     cfg.key, "; ".join(foreign))  # fmt: skip
            return False
        try:
            placed = durable_storage(job, pool)
        except ValueError as exc:
            log.info(
                "%s stays on %s: its storage does not fit WarmPool %s (%s)", rec.key, rec.pool, cfg.key, exc
            )
            return False
        rec.artifact_dir, rec.checkpoint_root = placed.artifact, placed.checkpoints
        return True

    def cancel_job(self, key: str) -> None:
        def apply() -> None:
            self._held.pop(key, None)
            self._resources.pop(key, None)
            self.core.cancel(key)

        self.call(apply, wait=30)
        self._posted.pop(key, None)

    def upsert_adapter(self, body: dict[str, Any]) -> None:
        """A LoRAAdapter was created, changed, or seen again after a restart."""
        meta = body.get("metadata", {})
        try:
            res = parse_resource(body)
            assert isinstance(res, LoRAAdapter)
        except InvalidResource as exc:
            self._adapter_invalid(meta, "; ".join(exc.errors))
            return
        rec = AdapterRecord(
            namespace=res.metadata.namespace or "default",
            name=res.metadata.name or "",
            spec=res.spec,
            generation=res.metadata.generation or 1,
            # Seeded from the stored status so `loadedOn[].since` survives an operator restart.
            status=res.status or LoRAAdapterStatus(),
        )
        if not any(p.model == res.spec.base_model for p in list(self.core.pools.values())):
            self._refresh_pools()  # a WarmPool applied together with the adapter may not be handled yet
        if res.spec.artifact_secret:
            self._mount_s3_secret(rec.namespace, res.spec.base_model, res.spec.artifact_secret)
        self.call(lambda: self.core.serving.upsert_adapter(rec), wait=30)

    def _mount_s3_secret(self, namespace: str, model: str, secret: str) -> None:
        """The Secret an s3:// artifact names, mounted into the pods of the pool the resource of
        ``namespace`` uses for ``model`` (``ControlCore.resolve``: its namespace's, else an admitting
        one, where the Secret must exist: a pod reads Secrets of its own namespace only). By name: the
        operator never reads S3 credentials."""

        def mount() -> None:
            cfg = self.core.resolve(namespace, model)
            if cfg is not None and cfg.namespace == namespace:  # a borrower's is refused (borrowing)
                self.backend.use_s3_secret(cfg.key, secret)

        self.call(mount)

    def delete_adapter(self, namespace: str, name: str) -> list[str]:
        """Unload it from every pod; returns the pods still holding it (empty: the finalizer may go)."""

        def apply() -> list[str]:
            workers = self.bus.workers()
            if self.core.serving.delete_adapter(namespace, name, workers):
                self._adapters_dirty.pop(f"{namespace}/{name}", None)
                return []
            return holders_of(adapter_id(namespace, name), workers)

        held: list[str] = self.call(apply, wait=30)
        return held

    def namespace_models(self) -> dict[str, set[str]]:
        """namespace → the served names its API keys may reach by default (read in the core thread,
        where pools and adapters change)."""
        models: dict[str, set[str]] = self.call(
            lambda: namespace_models(self._pools.values(), self.core.serving.adapters.values()), wait=10
        )
        return models

    def _refresh_pools(self) -> None:
        try:
            items = self.api.list_cluster_custom_object(GROUP, VERSION, PLURAL_WARM_POOLS).get("items", [])
        except ApiException as exc:
            log.warning("cannot list WarmPools: %s", exc.reason)
            return
        for body in items:
            try:
                self.upsert_pool(body)
            except InvalidResource as exc:
                log.warning("skipping invalid WarmPool: %s", exc)

    # -- status -------------------------------------------------------------------------------------
    def _on_status(self, job: JobRecord) -> None:
        self._dirty[job.key] = job
        if job.terminal or job.attempt:  # dispatched or ended: it no longer moves pools (_on_move)
            self._resources.pop(job.key, None)

    def _on_adapter_status(self, rec: AdapterRecord) -> None:
        self._adapters_dirty[rec.key] = rec

    def _persist(self, job: JobRecord) -> bool:
        """Write the job's status now (the core records an attempt before any worker hears of it)."""
        ns, name = job.key.split("/", 1)
        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, {"status": status_patch(job)}
            )
        except Exception as exc:  # ApiException, or the API server unreachable: tried again next round
            log.warning("status of %s not stored (%s); its attempt waits", job.key, exc)
            return False
        if self._dirty.get(job.key) is job:
            del self._dirty[job.key]
        self._post_transitions(job, ns, name)
        return True

    def _on_publish(self, job: JobRecord, rec: AdapterRecord) -> None:
        """Tune -> serve: the job's LoRAAdapter, owned by the job (it goes when the job goes) and
        labelled back to it, created now: the core records it in status only once this returned. One
        that this job created before a restart is taken as it is; one of that name the job did not
        create is refused (PublishRefused: PublishNameTaken). Any other API error is raised and the
        core retries. The kopf handler then registers it like any LoRAAdapter."""
        _, job_name = job.key.split("/", 1)
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND_LORA_ADAPTER,
            "metadata": {
                "name": rec.name,
                "namespace": rec.namespace,
                "labels": {LABEL_JOB: job_name},
                "ownerReferences": [
                    {
                        "apiVersion": API_VERSION,
                        "kind": KIND_TUNING_JOB,
                        "name": job_name,
                        "uid": job.uid,
                        "blockOwnerDeletion": False,
                    }
                ],
            },
            "spec": rec.spec.model_dump(by_alias=True, mode="json", exclude_none=True),
        }
        try:
            self.api.create_namespaced_custom_object(
                GROUP, VERSION, rec.namespace, PLURAL_LORA_ADAPTERS, body
            )
            log.info("published LoRAAdapter %s", rec.key)
            failpoint(PUBLISH_AFTER_CREATE)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = self.api.get_namespaced_custom_object(
            GROUP, VERSION, rec.namespace, PLURAL_LORA_ADAPTERS, rec.name
        )
        owners = (existing.get("metadata") or {}).get("ownerReferences") or []
        if not any(o.get("kind") == KIND_TUNING_JOB and o.get("uid") == job.uid for o in owners):
            raise PublishRefused(
                Reason.PUBLISH_NAME_TAKEN,
                f"LoRAAdapter {rec.key} already exists and was not created by this TuningJob (no owner "
                f"reference to it); the tuned prompt is not published. Delete that adapter, or publish "
                f"under another name (spec.output.publish) by re-creating the job",
            )
        log.info("LoRAAdapter %s was published before a restart", rec.key)

    def _flush(self) -> None:
        dirty = list(self._dirty.items())
        self._dirty.clear()
        if dirty:
            # In parallel: after a burst of creations every job has a status to write, and one round
            # trip at a time would make the last job wait for all the others.
            list(self._writers.map(lambda item: self._write_status(*item), dirty))
        adapters = list(self._adapters_dirty.items())
        self._adapters_dirty.clear()
        if adapters:
            list(self._writers.map(lambda item: self._write_adapter_status(*item), adapters))
        now = time.monotonic()
        if now >= self._next_pool_status:
            self._next_pool_status = now + POOL_STATUS_SECONDS
            self._flush_pools()

    def _write_status(self, key: str, job: JobRecord) -> None:
        ns, name = key.split("/", 1)
        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, {"status": status_patch(job)}
            )
        except ApiException as exc:
            if exc.status != 404:  # 404: deleted meanwhile
                self._dirty.setdefault(key, job)  # retried next round
                log.warning("status patch of %s failed: %s %s", key, exc.status, exc.reason)
            return
        self._post_transitions(job, ns, name)

    def _write_adapter_status(self, key: str, rec: AdapterRecord) -> None:
        patch = {"status": rec.status.model_dump(by_alias=True, mode="json", exclude_none=True)}
        # Lists are replaced by a merge patch; an adapter unloaded everywhere must show an empty list.
        patch["status"].setdefault("loadedOn", [])
        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, rec.namespace, PLURAL_LORA_ADAPTERS, rec.name, patch
            )
        except ApiException as exc:
            if exc.status != 404:
                self._adapters_dirty.setdefault(key, rec)
                log.warning("status patch of LoRAAdapter %s failed: %s %s", key, exc.status, exc.reason)

    def _adapter_invalid(self, meta: dict[str, Any], message: str) -> None:
        """Passed the CRD schema but not the model: Ready=False with the reason, nothing else touched."""
        ns, name = meta.get("namespace"), meta.get("name")
        stamp = units.format_timestamp(datetime.now(UTC))
        conditions = [
            {
                "type": ctype,
                "status": "False",
                "reason": Reason.INVALID_SPEC,
                "message": message[:32768],
                "lastTransitionTime": stamp,
                "observedGeneration": meta.get("generation"),
            }
            for ctype in (ConditionType.READY, ConditionType.LOADED)
        ]
        body = {"status": {"conditions": conditions, "observedGeneration": meta.get("generation")}}
        self.api.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL_LORA_ADAPTERS, name, body)
        self._event(ns, name, KIND_LORA_ADAPTER, Reason.INVALID_SPEC, message, True, meta.get("uid", ""))

    def _post_transitions(self, job: JobRecord, ns: str, name: str) -> None:
        seen = self._posted.setdefault(job.key, set())
        for c in job.status.conditions:
            mark = (c.type, c.status, c.reason)
            if mark in seen or c.status == "Unknown" or (c.type, c.status) in QUIET_CONDITIONS:
                continue
            seen.add(mark)
            failed = c.type == ConditionType.FAILED or (
                c.type == ConditionType.SUCCEEDED and c.status == "False"
            )
            self._event(ns, name, "TuningJob", c.reason, c.message or f"{c.type}={c.status}", failed, job.uid)

    def _event(
        self, ns: str, name: str, kind: str, reason: str, message: str, warning: bool, uid: str
    ) -> None:
        now = datetime.now(UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{name}.", namespace=ns),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=kind, name=name, namespace=ns, uid=uid
            ),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            source=client.V1EventSource(component="elastune-operator"),
        )
        try:
            self.events_api.create_namespaced_event(ns, body)
        except ApiException as exc:  # events are best effort
            log.debug("event not posted: %s", exc.reason)

    def _fail_invalid(self, meta: dict[str, Any], message: str, reason: str = Reason.INVALID_SPEC) -> None:
        """Refused at validation: Accepted=False, Succeeded=False and Failed=True with ``reason``."""
        ns, name = meta.get("namespace"), meta.get("name")
        stamp = units.format_timestamp(datetime.now(UTC))
        cond = {
            "type": ConditionType.SUCCEEDED,
            "status": "False",
            "reason": reason,
            "message": message[:32768],
            "lastTransitionTime": stamp,
            "observedGeneration": meta.get("generation"),
        }
        failed = {**cond, "type": ConditionType.FAILED, "status": "True"}
        accepted = {**cond, "type": ConditionType.ACCEPTED}
        body = {
            "status": {"conditions": [accepted, cond, failed], "observedGeneration": meta.get("generation")}
        }
        self.api.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL_TUNING_JOBS, name, body)
        self._event(ns, name, "TuningJob", reason, message, True, meta.get("uid", ""))

    def _flush_pools(self) -> None:
        st = self.core.state
        est = self.core.estimator
        for key, pool in self._pools.items():
            if key not in st.pool_size:  # the scheduler's per-pool state, by pool id
                continue
            c = st.counts(key)
            observed = est.observed_iteration_seconds(key)
            status = WarmPoolStatus(
                observed_generation=pool.metadata.generation,
                warm_gpus=c["idle"] + c["held"] + c["busy"],
                busy_gpus=c["busy"] + c["held"],
                idle_gpus=c["idle"],
                starting_gpus=c["starting"],
                cold_start_seconds=units.format_decimal(round(est.cold_start(key), 3)),
                iteration_seconds={str(k): units.format_decimal(round(v, 6)) for k, v in observed.items()}
                or None,
            ).model_dump(by_alias=True, mode="json", exclude_none=True)
            self._write_pool_status(key, status)
        for key, pool in list(self._fetching.items()):  # a fetched model lets its pool's workers start
            if self._model_ready(key, pool):
                for held in self._apply_pool(pool):
                    self._writers.submit(self.submit_job, held)
        if self.redis_budget is not None and time.monotonic() >= self._next_budget_check:
            self._next_budget_check = time.monotonic() + redis_budget.CHECK_S
            try:
                for key in self.redis_budget.check(list(self._pools.values())).cut:
                    self._budget_exceeded(key)
            except Exception as exc:  # Redis down, no rights: the next check tries again
                log.warning("Redis budget check failed: %s", exc)
        if self.redis_users is not None:
            self.redis_users.tick(list(self._pools.values()))
            if self._no_redis_user and time.monotonic() >= self._next_user_retry:
                self._next_user_retry = time.monotonic() + USER_RETRY_S  # granted rights are picked up
                for _key, pool in list(self._no_redis_user.items()):
                    for held in self._apply_pool(pool):
                        self._writers.submit(self.submit_job, held)
        refused = [*self._rejected.items(), *self._unsupported.items(), *self._no_redis_user.items()]
        for key, pool in [*refused, *self._fetching.items()]:
            status = WarmPoolStatus(observed_generation=pool.metadata.generation).model_dump(
                by_alias=True, mode="json", exclude_none=True
            )
            self._write_pool_status(key, status)

    def _write_pool_status(self, key: str, status: dict[str, Any]) -> None:
        conditions = self._pool_conditions.get(key)
        if conditions:
            status["conditions"] = [
                c.model_dump(by_alias=True, mode="json", exclude_none=True) for c in conditions
            ]
        if self._pool_status.get(key) == status:
            return
        ns, name = key.split("/", 1)
        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL_WARM_POOLS, name, {"status": status}
            )
            self._pool_status[key] = status
        except ApiException as exc:
            log.debug("pool status patch failed: %s", exc.reason)


PROOF_KEY_ENV = "ELASTUNE_PROOF_KEY"
"""The key of the attempts' proofs (protocol.attempt_proof), from a Secret of the chart: stable across
restarts, so a restarted operator accepts the events of the attempts it adopts. Unset: one per process."""


def _proof_key() -> dict[str, bytes]:
    raw = os.environ.get(PROOF_KEY_ENV, "").strip()
    return {"proof_key": raw.encode()} if raw else {}
