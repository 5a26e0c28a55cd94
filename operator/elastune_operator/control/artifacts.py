"""What the operator can check of a LoRAAdapter's artifact before any worker loads it (no torch).

It reads the PEFT directory's adapter_config.json where the artifact is visible to the control plane (a
local path in `elastune serve`; a pvc:// claim mounted at $ELASTUNE_PVC_ROOT). Where it is not (a claim
only the worker pods mount) the check is left to the worker's load, whose error comes back through the
registry as the same kind of condition. s3:// is the workers' to read (the operator never holds the
credentials of the Secret the spec names): their download's reason comes back the same way, e.g.
StorageAccessDenied. http(s):// is refused here, as the workers refuse it: not implemented.

The base model is checked by the worker (shapes of the adapter's weights against the loaded model):
``base_model_name_or_path`` is often a local path at training time and proves nothing here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from elastune_contract import storage
from elastune_contract.api.loraadapter import LoRAAdapterSpec
from elastune_contract.vocabulary import Reason

# PEFT's peft_type values by the LoRAAdapter type they serve as.
_PEFT_TYPES = {"lora": {"LORA"}, "promptTuning": {"PROMPT_TUNING", "P_TUNING"}}


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class ArtifactInfo:
    url: str
    """What workers load: the spec's URL, with a relative path made absolute (local mode)."""
    rank: int | None = None
    """LoRA rank read from the artifact (None: a soft prompt, or not readable here)."""
    checked: bool = False
    """Whether the control plane could read it (else the worker's load decides)."""


def resolve_url(url: str, base_dir: Path | None) -> str:
    """A relative artifact path is relative to the manifest (``elastune serve``), like datasets."""
    if "://" in url or url.startswith("/") or base_dir is None:
        return url
    return str((base_dir / url).resolve())


def _local_dir(url: str) -> Path | None:
    """The artifact's directory as this process sees it (the one resolver of pvc://, as the workers');
    None where it cannot: a claim root this process does not mount, or a scheme without a path.
    ValueError for a malformed URI."""
    loc = storage.parse(url)
    # The claim itself must be mounted here, not only the root: an operator image or node that happens
    # to have /mnt/pvc would otherwise judge every published artifact missing.
    if not loc.is_local or (loc.scheme == storage.PVC and not (storage.pvc_root() / loc.authority).is_dir()):
        return None
    return storage.local_path(loc)


def inspect(
    spec: LoRAAdapterSpec, max_rank: int, base_dir: Path | None = None, *, check_paths: bool = True
) -> ArtifactInfo | Problem:
    """The artifact as far as the control plane can see it, or the first problem with a reason.

    ``check_paths=False``: file:// and plain paths name the worker pods' filesystem, which the operator
    does not see (a pod of its own on Kubernetes); the workers' load checks them instead."""
    url = resolve_url(spec.artifact_url, base_dir)
    scheme = urlsplit(url).scheme
    if scheme == "s3":  # the workers download it with the Secret the spec names: their load decides
        return ArtifactInfo(url)
    if scheme in ("http", "https"):
        return Problem(
            Reason.ARTIFACT_UNSUPPORTED_SCHEME,
            f"{scheme}:// artifacts are not implemented by the workers yet; use s3://<bucket>/<prefix>, or "
            "put the PEFT directory on a PersistentVolumeClaim the WarmPool mounts and use pvc://<claim>/<path>",
        )
    try:
        local = _local_dir(url)
    except ValueError as exc:  # path traversal, a claim name pvc:// cannot address
        return Problem(Reason.INVALID_SPEC, f"artifactURL: {exc}")
    if not check_paths and scheme in ("", "file"):
        local = None
    if local is None:  # a claim mounted only in the worker pods: their load checks it
        return ArtifactInfo(url)
    if not local.is_dir():
        return Problem(
            Reason.ARTIFACT_NOT_FOUND, f"artifactURL {spec.artifact_url}: {local} is not a directory"
        )
    config_path = local / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        return Problem(
            Reason.NOT_A_PEFT_ADAPTER,
            f"{local} has no adapter_config.json: not a PEFT save_pretrained directory",
        )
    except (OSError, ValueError) as exc:
        return Problem(Reason.NOT_A_PEFT_ADAPTER, f"{config_path} cannot be read as JSON: {exc}")
    if not isinstance(config, dict):
        return Problem(Reason.NOT_A_PEFT_ADAPTER, f"{config_path} is not a JSON object")
    peft_type = str(config.get("peft_type", ""))
    if peft_type not in _PEFT_TYPES[spec.type]:
        return Problem(
            Reason.ARTIFACT_MISMATCH,
            f"spec.type is {spec.type} but the artifact's peft_type is {peft_type or 'missing'} "
            f"(expected {' or '.join(sorted(_PEFT_TYPES[spec.type]))})",
        )
    if spec.type != "lora":
        return ArtifactInfo(url, None, checked=True)
    return _check_lora(spec, config, max_rank, url)


def _check_lora(
    spec: LoRAAdapterSpec, config: dict[str, object], max_rank: int, url: str
) -> ArtifactInfo | Problem:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        return Problem(Reason.NOT_A_PEFT_ADAPTER, f"adapter_config.json has no valid LoRA rank r ({rank!r})")
    mismatches = []
    if spec.rank is not None and spec.rank != rank:
        mismatches.append(f"rank {spec.rank} in the spec, {rank} in the artifact")
    alpha = config.get("lora_alpha")
    if spec.alpha is not None and spec.alpha != alpha:
        mismatches.append(f"alpha {spec.alpha} in the spec, {alpha} in the artifact")
    targets = config.get("target_modules")
    if spec.target_modules is not None:
        given = set(targets) if isinstance(targets, list | tuple | set) else {str(targets)}
        if set(spec.target_modules) != given:
            mismatches.append(
                f"targetModules {sorted(spec.target_modules)} in the spec, {sorted(given)} in the artifact"
            )
    if mismatches:
        return Problem(Reason.ARTIFACT_MISMATCH, "; ".join(mismatches))
    if rank > max_rank:
        return Problem(
            Reason.RANK_ABOVE_MAXIMUM,
            f"rank {rank} is above the WarmPool's serving.maxLoraRank ({max_rank})",
        )
    return ArtifactInfo(url, rank, checked=True)
