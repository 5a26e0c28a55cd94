"""Which adapter a request is served with: a typed reference, resolved once from the served name at the
worker's API and carried as such to the engine's sequence (pure: the API, the front end and the engine's
pure core all import it).

A served name is resolved within a namespace (issue 25 item 1): two namespaces may each have a LoRAAdapter
``summarizer``. The control plane's placement names each adapter by ``namespace/name``
(``elastune_contract.protocol.adapter_id``, the same string as ``adapter_key``), the worker's placement
sync loads it with its namespace, the gateway resolves a request's name once and signs the adapter's id
for the worker, whose API looks the adapter up by that id (``routes.lookup_adapter``); everything keyed by
``AdapterRef.key`` keeps the two apart. ``DEFAULT_NAMESPACE`` is left for adapters loaded by name alone
(by hand through ``/v1/load_lora_adapter``, ``--lora-modules``, benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

AdapterKind = Literal["lora", "soft_prompt"]

DEFAULT_NAMESPACE = ""
"""The namespace of an adapter loaded by name alone (by hand, at start-up, in benchmarks); the control
plane's placements always name the LoRAAdapter's namespace."""


def adapter_key(namespace: str, name: str) -> str:
    """The engine's key of an adapter: its name in the default namespace, ``namespace/name`` in another
    (a Kubernetes name holds no ``/``, so the two never meet)."""
    return name if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}"


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One loaded adapter, as the engine registered it."""

    kind: AdapterKind
    namespace: str
    name: str
    """The name clients send as ``model``."""
    id: int
    """Unique per load within one engine: a request resolved against an adapter that has since been
    unloaded (and perhaps loaded again, other weights under the same name) is told so, and its prefix-cache
    blocks never mix with the new load's."""

    @property
    def key(self) -> str:
        return adapter_key(self.namespace, self.name)

    @property
    def is_lora(self) -> bool:
        return self.kind == "lora"


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A loaded adapter as the engine reports it: the reference requests use, its artifact, its rank (0
    for a soft prompt) and where it is now (device | host | storage)."""

    ref: AdapterRef
    path: str
    rank: int
    tier: str

    @property
    def name(self) -> str:
        return self.ref.name


def resolve(
    served_name: str, loaded: Iterable[AdapterRef], namespace: str = DEFAULT_NAMESPACE
) -> AdapterRef | None:
    """The adapter served as ``served_name`` in ``namespace``; None when no loaded adapter is."""
    key = adapter_key(namespace, served_name)
    return next((ref for ref in loaded if ref.key == key), None)
