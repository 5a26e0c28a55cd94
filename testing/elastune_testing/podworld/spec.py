"""What a kubelet makes of a pod spec, as plain data: the argv, the environment, the mounts.

Pure translation (no namespaces, no processes) so each rule is testable alone:

- images map to environments of this host (`Image`): ENTRYPOINT/CMD/ENV as a Dockerfile gives them
  and the host paths the image "bakes in" (the virtualenv, the model cache); an image with no entry
  is one no registry has (ImagePullBackOff);
- ``command`` replaces ENTRYPOINT and ``args`` replaces CMD, ``$(VAR)`` expanded from the container's
  env, as the kubelet does;
- env exactly as the spec says (value, fieldRef of the downward API, secretKeyRef, configMapKeyRef,
  envFrom), over the image's ENV; nothing of the host's environment leaks in;
- volumes: a PersistentVolumeClaim is a directory per namespace and claim (shared by every pod that
  mounts it), emptyDir a directory per pod, Secrets and ConfigMaps files per key; the service account
  token, CA and namespace are projected at the usual path unless automountServiceAccountToken is false.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Host directories a container has its own copy of: a mount point under them is made in a private tmpfs.
SHADOWABLE = frozenset({"/mnt", "/run", "/media", "/srv", "/opt"})
Lookup = Callable[[str, str, str], "dict[str, Any] | None"]
"""(kind: 'Secret' | 'ConfigMap' | 'PersistentVolumeClaim', namespace, name) -> the object or None."""


class ContainerConfigError(Exception):
    """The pod cannot start as specified (kubelet: CreateContainerConfigError)."""


class NotSchedulable(Exception):
    """The pod stays Pending (a claim that does not exist, more GPUs than any node has free)."""


@dataclass(frozen=True)
class Image:
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    binds: tuple[str, ...] = ()
    """Host paths visible read-only at the same path in the pod (what the image carries)."""
    workdir: str = "/"
    """The image's WORKDIR: a container without workingDir starts there, as the runtime starts it."""


@dataclass(frozen=True)
class Mount:
    source: Path
    target: str
    read_only: bool = False


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    workdir: str = "/"


def image_repository(image: str) -> str:
    """``registry/repo:tag@digest`` -> ``registry/repo`` (a port in the registry is kept)."""
    name = image.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    if ":" in last:
        last = last.split(":", 1)[0]
    return f"{head}/{last}" if head else last


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: unknown references stay as written, $$ escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, text)


def field_ref(path: str, pod: Mapping[str, Any], pod_ip: str) -> str:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "status.podIP": pod_ip,
        "status.hostIP": pod_ip.rsplit(".", 1)[0] + ".1",
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise ContainerConfigError(f"unsupported fieldRef {path!r}")


def _data(obj: Mapping[str, Any], kind: str) -> dict[str, str]:
    out = {k: str(v) for k, v in (obj.get("stringData") or {}).items()} if kind == "Secret" else {}
    for k, v in (obj.get("data") or {}).items():
        out.setdefault(k, base64.b64decode(v).decode() if kind == "Secret" else str(v))
    return out


def _key_ref(ref: Mapping[str, Any], kind: str, ns: str, lookup: Lookup) -> str | None:
    obj = lookup(kind, ns, ref["name"])
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    data = _data(obj, kind)
    if ref["key"] not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
    return data[ref["key"]]


def container_env(
    container: Mapping[str, Any], pod: Mapping[str, Any], pod_ip: str, image: Image, lookup: Lookup
) -> dict[str, str]:
    ns = (pod.get("metadata") or {}).get("namespace", "default")
    env = dict(image.env)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            if key in source:
                obj = lookup(kind, ns, source[key]["name"])
                if obj is None and not source[key].get("optional"):
                    raise ContainerConfigError(f'{kind.lower()} "{source[key]["name"]}" not found')
                env.update({prefix + k: v for k, v in _data(obj or {}, kind).items()})
    for e in container.get("env") or []:
        name, value_from = e["name"], e.get("valueFrom")
        if value_from is None:
            env[name] = expand(str(e.get("value", "")), env)
        elif "fieldRef" in value_from:
            env[name] = field_ref(value_from["fieldRef"]["fieldPath"], pod, pod_ip)
        elif "secretKeyRef" in value_from:
            v = _key_ref(value_from["secretKeyRef"], "Secret", ns, lookup)
            if v is not None:
                env[name] = v
        elif "configMapKeyRef" in value_from:
            v = _key_ref(value_from["configMapKeyRef"], "ConfigMap", ns, lookup)
            if v is not None:
                env[name] = v
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(value_from)}")
    return env


def argv_of(container: Mapping[str, Any], image: Image, env: Mapping[str, str]) -> list[str]:
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = list(command) + list(args or [])
    else:
        argv = list(image.entrypoint) + list(args if args is not None else image.cmd)
    if not argv:
        raise ContainerConfigError("no command specified")
    return [expand(str(a), env) for a in argv]


def volumes_of(
    pod: Mapping[str, Any], container: Mapping[str, Any], pod_dir: Path, pvc_root: Path, lookup: Lookup
) -> list[Mount]:
    """The container's mounts with their host directories (created and filled here)."""
    ns = (pod.get("metadata") or {}).get("namespace", "default")
    sources: dict[str, tuple[Path, bool]] = {}
    for vol in (pod.get("spec") or {}).get("volumes") or []:
        name = vol["name"]
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            if lookup("PersistentVolumeClaim", ns, claim) is None:
                raise NotSchedulable(f'persistentvolumeclaim "{claim}" not found')
            path = pvc_root / ns / claim
            sources[name] = (path, bool(vol["persistentVolumeClaim"].get("readOnly")))
        elif "emptyDir" in vol:
            sources[name] = (pod_dir / "emptydir" / name, False)
        elif "secret" in vol or "configMap" in vol:
            kind = "Secret" if "secret" in vol else "ConfigMap"
            ref = vol["secret"] if kind == "Secret" else vol["configMap"]
            obj_name = ref.get("secretName") if kind == "Secret" else ref.get("name")
            obj = lookup(kind, ns, obj_name)
            if obj is None and not ref.get("optional"):
                raise ContainerConfigError(f'{kind.lower()} "{obj_name}" not found')
            files = _data(obj or {}, kind)
            if ref.get("items"):
                files = {i["path"]: files[i["key"]] for i in ref["items"] if i["key"] in files}
            path = pod_dir / kind.lower() / name
            _write_files(path, files)
            sources[name] = (path, True)
        else:
            raise ContainerConfigError(f"volume {name}: unsupported source {sorted(set(vol) - {'name'})}")
    for path, _ in sources.values():
        path.mkdir(parents=True, exist_ok=True)
    mounts: list[Mount] = []
    for m in container.get("volumeMounts") or []:
        if m["name"] not in sources:
            raise ContainerConfigError(f"volumeMount {m['name']!r} names no volume of the pod")
        path, read_only = sources[m["name"]]
        if m.get("subPath"):
            path = path / m["subPath"]
            path.mkdir(parents=True, exist_ok=True)
        mounts.append(Mount(path, m["mountPath"], read_only or bool(m.get("readOnly"))))
    return mounts


def service_account_mount(pod_dir: Path, token: str, ca_pem: str, namespace: str) -> Mount:
    path = pod_dir / "serviceaccount"
    _write_files(path, {"token": token, "ca.crt": ca_pem, "namespace": namespace})
    return Mount(path, SA_DIR, read_only=True)


def _write_files(path: Path, files: Mapping[str, str]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for key, value in files.items():
        target = path / key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(value, encoding="utf-8")
        target.chmod(0o644)
