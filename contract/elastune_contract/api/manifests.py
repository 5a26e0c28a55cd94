"""Read manifest files and check each object the way the API server (CRD schema) and the operator
(models) will: shared by `elastune validate` and `elastune run`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elastune_contract.api.crdcheck import validate_against_crd
from elastune_contract.api.crds import render_crds
from elastune_contract.api.resources import AnyResource, InvalidResource, parse_resource
from elastune_contract.api.warmpool import ENGINE_GPUS_PER_POD, GPUS_PER_POD_MESSAGE, WarmPool


@dataclass
class Manifest:
    file: Path
    doc: dict[str, Any]
    resource: AnyResource | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        meta = self.doc.get("metadata") or {}
        return f"{self.doc.get('kind', '?')}/{meta.get('name', '?') if isinstance(meta, dict) else '?'}"


@functools.cache
def _crds() -> dict[str, dict[str, Any]]:
    out = {}
    for text in render_crds().values():
        crd = yaml.safe_load(text)
        out[crd["spec"]["names"]["kind"]] = crd
    return out


def check(doc: Any, file: Path) -> Manifest:
    if not isinstance(doc, dict):
        return Manifest(file, {}, problems=[f"<root>: must be an object; got {type(doc).__name__}"])
    if doc.get("kind") == "Secret" and doc.get("apiVersion") == "v1":
        # Local mode's S3 credentials (a resource's artifactSecret / output.secretName): no CRD to check;
        # `elastune run` and `elastune serve` hand them to their workers (local.s3_secrets).
        return Manifest(file, doc)
    crd = _crds().get(doc.get("kind", ""))
    problems = validate_against_crd(doc, crd) if crd else [f"kind: unknown kind {doc.get('kind')!r}"]
    resource = None
    try:
        resource = parse_resource(doc)
    except InvalidResource as exc:
        # The models check what the schema checks and more: a field the schema already named is said
        # once (issue 41 item 6: every error was printed twice), the rest (semantic checks) as well.
        named = {_field_of(p) for p in problems}
        problems += [e for e in exc.errors if _field_of(e) not in named]
    # A CEL rule the model leaves out on purpose (the operator must still read such a stored pool to
    # refuse it), so it is checked here, as the apiserver would.
    if isinstance(resource, WarmPool) and resource.spec.gpus_per_pod > ENGINE_GPUS_PER_POD:
        problems.append(f"spec.gpusPerPod: {GPUS_PER_POD_MESSAGE}")
    return Manifest(file, doc, resource if not problems else None, problems)


def _field_of(problem: str) -> str:
    """The field path a problem names: ``spec.deadline: must be ...`` -> ``spec.deadline``, and the
    apiserver's ``unknown field "spec.foo"`` -> ``spec.foo``."""
    if problem.startswith('unknown field "') and problem.endswith('"'):
        return problem[len('unknown field "') : -1]
    return problem.partition(": ")[0].strip()


def load(files: list[Path]) -> list[Manifest]:
    """Every object of every file, checked; unreadable files raise OSError / yaml.YAMLError."""
    out = []
    for file in files:
        for doc in yaml.safe_load_all(Path(file).read_text()):
            if doc:
                out.append(check(doc, Path(file)))
    return out
