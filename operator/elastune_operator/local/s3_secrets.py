"""Local mode's S3 credentials: the Secret manifests given with `elastune run -f` / `elastune serve -f`.

On Kubernetes a Secret a resource names (LoRAAdapter ``spec.artifactSecret``, TuningJob
``spec.output.secretName``) is mounted into the pool's worker pods, one file per key. Locally the same
layout is written under ``<state-dir>/s3-secrets/<name>/`` (owner-only) and the worker processes are
pointed at it, so they read credentials exactly as pods do. Without a Secret manifest, a resource that
names none uses the workers' environment: the standard AWS_* variables of the shell running elastune.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path

import yaml

from elastune_contract.api.constants import S3_SECRETS_ROOT_ENV
from elastune_contract.api_keys import is_api_key_secret

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def worker_env(files: list[Path], state_dir: Path) -> dict[str, str]:
    """Write the files' v1 Secrets as their volumes would mount them; the workers' extra environment."""
    secrets: dict[str, dict[str, str]] = {}
    for file in files:
        for doc in yaml.safe_load_all(Path(file).read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "Secret" and doc.get("apiVersion") == "v1":
                if is_api_key_secret(doc):
                    continue  # API keys go to the gateway as hashes (local.api_keys), never to workers
                name = str((doc.get("metadata") or {}).get("name") or "")
                data = {k: base64.b64decode(str(v)).decode() for k, v in (doc.get("data") or {}).items()}
                data.update({k: str(v) for k, v in (doc.get("stringData") or {}).items()})
                # Kubernetes' own rules for names and keys keep every file inside its folder.
                if _NAME.match(name) and all(_KEY.match(k) for k in data):
                    secrets[name] = data
    if not secrets:
        return {}
    root = state_dir / "s3-secrets"
    shutil.rmtree(root, ignore_errors=True)  # only this run's Secrets
    root.mkdir(mode=0o700, parents=True)
    for name, data in secrets.items():
        folder = root / name
        folder.mkdir(mode=0o700)
        for key, value in data.items():
            fd = os.open(folder / key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(value)
    return {S3_SECRETS_ROOT_ENV: str(root)}
