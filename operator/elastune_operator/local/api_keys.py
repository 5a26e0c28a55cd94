"""Local mode's API keys: the key Secrets among the ``elastune serve -f`` files (issue 25 item 2).

The same Secrets as on Kubernetes (``elastune.dev/api-key: "true"``, ``stringData.key``, optional
``models``, ``requestsPerMinute``, ``tokensPerMinute``) are read from the files and published to the local
registry as the operator would (SHA-256 digests with scopes and limits, never a key). The files are read
again every few seconds, so a key Secret removed from them (or its file deleted) stops working within
seconds. With no key Secret at start, ``elastune serve`` runs the gateway without authentication on
loopback only, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from elastune_contract.api_keys import (
    InvalidApiKeySecret,
    KeySecret,
    is_api_key_secret,
    key_map,
    publish,
    read_secret,
)


class KeyFileError(ValueError):
    """A key Secret in the files that cannot be a key (the message names the Secret)."""


def key_secrets(files: Iterable[Path]) -> list[KeySecret]:
    """The API key Secrets of ``files`` (missing files hold none)."""
    out: list[KeySecret] = []
    for file in files:
        try:
            docs = list(yaml.safe_load_all(Path(file).read_text()))
        except FileNotFoundError:
            continue
        for doc in docs:
            if isinstance(doc, dict) and doc.get("apiVersion") == "v1" and is_api_key_secret(doc):
                try:
                    out.append(read_secret(doc))
                except InvalidApiKeySecret as exc:
                    raise KeyFileError(f"{file}: {exc}") from exc
    return out


class LocalKeys:
    def __init__(
        self,
        files: Callable[[], list[Path]],
        redis: Any,
        ns: str,
        namespace_models: Callable[[], Mapping[str, Iterable[str]]],
    ) -> None:
        self.files, self.redis, self.ns, self.namespace_models = files, redis, ns, namespace_models
        self._published = False

    def publish(self) -> int:
        """Read the files and write the whole key map (also re-asserting it after a Redis restart); the
        number of keys. At start a bad key Secret is an error; later, one broken file revokes every key
        until it is fixed (a key must never outlive a change that meant to revoke it)."""
        try:
            secrets = key_secrets(self.files())
        except (KeyFileError, OSError, yaml.YAMLError):
            if not self._published:
                raise
            secrets = []
        records = key_map(secrets, self.namespace_models())
        publish(self.redis, self.ns, records)
        self._published = True
        return len(records)
