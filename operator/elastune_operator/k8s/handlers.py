"""kopf handlers: a few lines each, handing the object to the runtime (docs/design.md §7).

Run with ``elastune operator [kopf run flags]`` (e.g. ``--all-namespaces --liveness=http://0.0.0.0:8080/healthz``).

- TuningJob create/resume → submitted to the control core (a resumed job with an attempt in flight is
  recovered, a finished one stays finished); delete → the attempt is cancelled and its GPUs released
  before kopf removes our finalizer.
- TuningJob spec changes after creation are rejected by the CRD (CEL ``self == oldSelf`` on spec); on an
  apiserver without CEL the operator ignores them and says so in a Warning event: the job keeps
  running with the spec it was accepted with. Delete and re-create it to change the spec.
- WarmPool create/resume/update (or its rotate.elastune.dev/redis-password annotation changed: a new Redis
  password, k8s.redis_users) → the pool is (re)configured and its Deployment applied; delete →
  jobs that still need it fail with WarmPoolDeleted (the Deployment goes with its owner reference). A pool
  is per namespace and model: another WarmPool of the same model in the same namespace is refused
  (Ready=False, DuplicateWarmPool) and touches nothing; deleting it touches nothing either (keyed by
  namespace/name), and when the serving pool goes a refused one of its namespace takes its place.
  Other namespaces' WarmPools of the model are pools of their own.
- Tenancy: a TuningJob or LoRAAdapter uses its own namespace's WarmPool of its model, else the pool of
  the lowest id among those listing its namespace in spec.allowedNamespaces ("*": all); with none the
  job waits (Scheduled=False, PoolNotShared) and the adapter is not served (Ready=False, PoolNotShared)
  until a pool admits it.
- LoRAAdapter create/resume/update → validated against its artifact and placed on the pool's pods
  (status follows what the workers really hold); delete → unloaded from every pod, and only then does
  kopf remove our finalizer (retried every 2 s while a pod still holds it).
- TuningJob and LoRAAdapter delete, after the handlers above → what spec.retention says goes is removed by
  a cleanup Job in the resource's namespace, bounded in time (k8s/retention_handlers.py).
- Secret events → the API key map the gateway reads: SHA-256 of each labelled key with its scope and
  limits (elastune_operator.api_keys), never the key. Only Secrets labelled ``elastune.dev/api-key=true``
  are listed and watched: the label selector goes to the apiserver (kopf's
  ``settings.watching.label_selectors``; a handler's ``labels=`` filters in the operator, after every
  Secret was sent to it), so no other Secret reaches the operator. A Secret whose label is removed leaves
  the selection, which a watch reports as DELETED: the key stops working too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf
from kubernetes import client, config

from elastune_contract.api.constants import (
    FINALIZER,
    GROUP,
    PLURAL_LORA_ADAPTERS,
    PLURAL_TUNING_JOBS,
    PLURAL_WARM_POOLS,
    VERSION,
)
from elastune_contract.api_keys import API_KEY_LABEL
from elastune_contract.vocabulary import Reason
from elastune_operator.api_keys import ApiKeyPublisher
from elastune_operator.k8s.redis_users import ROTATE_ANNOTATION
from elastune_operator.k8s.runtime import Runtime
from elastune_operator.k8s.settings import OperatorSettings

log = logging.getLogger("elastune.operator")
API_KEYS_ENV = "ELASTUNE_API_KEYS"
"""``false``: no API key Secrets are watched (the gateway runs without authentication)."""
API_KEY_SECRET_SELECTOR = f"{API_KEY_LABEL}=true"
"""The label selector of the Secret list/watch: exactly the label's documented value, ``true``."""

# What the startup handler puts in kopf's operator memo (every resource memo is a shallow copy of it):
MEMO_RUNTIME = "runtime"  # the Runtime that drives the control core
MEMO_API_KEYS = "api_keys"  # the ApiKeyPublisher, only when API key Secrets are watched


def _runtime(memo: kopf.Memo) -> Runtime:
    runtime: Runtime | None = memo.get(MEMO_RUNTIME)
    if runtime is None:
        raise kopf.TemporaryError("the runtime is starting", delay=1)
    return runtime


def _plain(body: Any) -> dict[str, Any]:
    """kopf's Body as plain dicts (what the API models parse)."""

    def conv(v: Any) -> Any:
        if hasattr(v, "items"):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [conv(x) for x in v]
        return v

    return conv(body)


def _counted(runtime: Runtime, name: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except kopf.TemporaryError:
        raise
    except TimeoutError as exc:
        raise kopf.TemporaryError(str(exc), delay=2) from exc
    except Exception:
        runtime.metrics.handler_errors.labels(name).inc()
        raise


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    # Handler progress in annotations, not status: our status schema is ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    if _api_keys_watched():
        watch_only_api_key_secrets(settings)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    opts = OperatorSettings.from_env()
    runtime = Runtime(opts, client.ApiClient())
    if opts.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(opts.metrics_port, registry=runtime.metrics.registry)
    runtime.start()
    memo[MEMO_RUNTIME] = runtime
    if _api_keys_watched():
        api_keys = ApiKeyPublisher(runtime.bus.redis, runtime.bus.ns, runtime.namespace_models)
        api_keys.start()
        memo[MEMO_API_KEYS] = api_keys
    log.info(
        "elastune operator started: bus %s, %s GPUs on the cold pool's nodes (%r)",
        opts.redis_url,
        runtime.nodes.total,
        opts.cold_pool_node_selector,
    )


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: Any) -> None:
    if (api_keys := memo.get(MEMO_API_KEYS)) is not None:
        api_keys.stop()
    if (runtime := memo.get(MEMO_RUNTIME)) is not None:
        runtime.stop()


@kopf.on.resume(GROUP, VERSION, PLURAL_WARM_POOLS)
@kopf.on.create(GROUP, VERSION, PLURAL_WARM_POOLS)
@kopf.on.update(GROUP, VERSION, PLURAL_WARM_POOLS, field="spec")
# A rotation of the pool's Redis password asked for (k8s.redis_users).
@kopf.on.update(GROUP, VERSION, PLURAL_WARM_POOLS, field=("metadata", "annotations", ROTATE_ANNOTATION))
def warm_pool_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    _counted(runtime, "warmpool", runtime.upsert_pool, _plain(body))


@kopf.on.delete(GROUP, VERSION, PLURAL_WARM_POOLS)
def warm_pool_deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    _counted(runtime, "warmpool_delete", runtime.delete_pool, _plain(body))


@kopf.on.resume(GROUP, VERSION, PLURAL_TUNING_JOBS)
@kopf.on.create(GROUP, VERSION, PLURAL_TUNING_JOBS)
def tuning_job_created(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    _counted(runtime, "tuningjob", runtime.submit_job, _plain(body))


@kopf.on.update(GROUP, VERSION, PLURAL_TUNING_JOBS, field="spec")
def tuning_job_spec_changed(body: kopf.Body, **_: Any) -> None:
    kopf.warn(
        body,
        reason=Reason.SPEC_CHANGE_IGNORED,
        message="spec is immutable once a TuningJob is created; it keeps running with the spec it was "
        "accepted with. Delete and re-create it to change the spec.",
    )


@kopf.on.delete(GROUP, VERSION, PLURAL_TUNING_JOBS)
def tuning_job_deleted(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    _counted(runtime, "tuningjob_delete", runtime.cancel_job, f"{namespace}/{name}")


@kopf.on.resume(GROUP, VERSION, PLURAL_LORA_ADAPTERS)
@kopf.on.create(GROUP, VERSION, PLURAL_LORA_ADAPTERS)
@kopf.on.update(GROUP, VERSION, PLURAL_LORA_ADAPTERS, field="spec")
def lora_adapter_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    _counted(runtime, "loraadapter", runtime.upsert_adapter, _plain(body))


@kopf.on.delete(GROUP, VERSION, PLURAL_LORA_ADAPTERS)
def lora_adapter_deleted(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    held = _counted(runtime, "loraadapter_delete", runtime.delete_adapter, namespace, name)
    if held:
        raise kopf.TemporaryError(f"still loaded on {', '.join(held)}; unloading", delay=2)


def secret_event(
    event: Any, body: kopf.Body, namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    """API key Secrets → the hashed key map (a deleted one, or one no longer labelled, stops working)."""
    api_keys: ApiKeyPublisher | None = memo.get(MEMO_API_KEYS)
    if api_keys is None:  # not started yet: the Secrets are all listed again when it is
        return
    if event.get("type") == "DELETED":
        api_keys.deleted(f"{namespace}/{name}")
    else:
        api_keys.seen(_plain(body))


def watch_only_api_key_secrets(settings: kopf.OperatorSettings) -> None:
    """List and watch only the Secrets labelled as API keys, the selector applied by the apiserver."""
    settings.watching.label_selectors["v1", "secrets"] = API_KEY_SECRET_SELECTOR


def _api_keys_watched() -> bool:
    return os.environ.get(API_KEYS_ENV, "true").lower() != "false"


if _api_keys_watched():
    # The chart sets it false with gateway.auth.enabled=false: then the operator has no list/watch on
    # Secrets and watches none.
    kopf.on.event("", "v1", "secrets")(secret_event)


# After the delete handlers above: an attempt is cancelled, an adapter unloaded, before its files go.
from elastune_operator.k8s import retention_handlers  # noqa: E402, F401
