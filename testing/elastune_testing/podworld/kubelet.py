"""The pod world's kubelet: runs the Pods of the API emulator as isolated processes, reports their status.

Level-triggered like the real one: every round it lists the Pods, starts the ones it does not run yet,
probes the running ones, restarts exited containers with back-off, and stops the processes of Pods that
are gone (SIGTERM, the pod's grace period, then SIGKILL). What it writes back is what a kubelet writes:
phase, podIP, conditions (PodScheduled, ContainersReady, Ready), containerStatuses with restartCount,
state (waiting: ImagePullBackOff / CreateContainerConfigError / CrashLoopBackOff; running; terminated)
and lastState.terminated (exit code, reason). Pods that ask for more GPUs than the emulated nodes have
free stay Pending with PodScheduled=False, reason Unschedulable.

One container per pod (every pod Elastune and its chart create has one); probes are polled at most
every second whatever their periodSeconds, so the tests do not wait on production cadences.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from elastune_testing.podworld import spec as S
from elastune_testing.podworld.network import PodNetwork
from elastune_testing.podworld.spec import SHADOWABLE

log = logging.getLogger("elastune.podworld.kubelet")
GPU = "nvidia.com/gpu"
PROBE_PERIOD_CAP_S = 1.0
WORLDS_LOCK = "/run/elastune-podworld.lock"
"""flock'ed shared by every running pod world (see Kubelet.start)."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Node:
    name: str
    gpus: int
    used: int = 0


@dataclass
class _Pod:
    uid: str
    namespace: str
    name: str
    obj: dict[str, Any]
    netns: str = ""
    ip: str = ""
    node: Node | None = None
    gpus: int = 0
    proc: subprocess.Popen[bytes] | None = None
    plan_path: Path | None = None
    restarts: int = 0
    started_at: str = ""
    next_start: float = 0.0
    waiting: tuple[str, str] | None = None
    last_terminated: dict[str, Any] | None = None
    ready: bool = False
    startup_done: bool = False
    next_probe: float = 0.0
    stopping: bool = False
    reported: str = ""
    scheduled_message: str | None = None


@dataclass
class Kubelet:
    api: client.ApiClient
    network: PodNetwork
    images: Mapping[str, S.Image]
    root: Path
    nodes: list[Node]
    service_account: Callable[[str], tuple[str, str]] | None = None
    """namespace -> (token, CA PEM) projected into pods that automount their service account token."""
    apiserver: tuple[str, int] | None = None
    """KUBERNETES_SERVICE_HOST/PORT given to every pod (the emulator's TLS front on the node)."""
    hosts: Callable[[str], str] = lambda ns: ""
    """namespace -> extra /etc/hosts lines (Service names as a pod of that namespace resolves them)."""
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 10.0
    period_s: float = 0.25
    pods: dict[str, _Pod] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _created_dirs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.root.mkdir(parents=True, exist_ok=True)

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        # Held shared while this world runs: the mount points it creates on the host are the same paths
        # every world's pods mount over, and removing one detaches that mount in every pod (Linux >= 3.18).
        self._worlds_lock = os.open(WORLDS_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._worlds_lock, fcntl.LOCK_SH)
        self._thread = threading.Thread(target=self._loop, name="podworld-kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        threads = [self._terminate_async(p, grace=5.0) for p in list(self.pods.values())]
        for t in threads:
            t.join(15)
        lock = getattr(self, "_worlds_lock", None)
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for d in reversed(self._created_dirs):
                with contextlib.suppress(OSError):  # not empty: something else uses it now
                    d.rmdir()
        except BlockingIOError:
            pass  # another pod world runs: its pods may mount over these paths, leave them
        finally:
            if lock is not None:
                os.close(lock)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.round()
            except Exception:  # keep the world running: the next round is level-triggered
                log.exception("kubelet round failed")

    def round(self) -> None:
        # Raw JSON, not the client's typed models: the pod world reads the API's own field names.
        resp: Any = self.core.list_pod_for_all_namespaces(_preload_content=False)
        items = json.loads(resp.data)["items"]
        seen: set[str] = set()
        for obj in items:
            meta = obj["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            pod = self.pods.get(uid)
            if pod is None:
                pod = self.pods[uid] = _Pod(uid, meta.get("namespace", "default"), meta["name"], obj)
            else:
                pod.obj = obj
            if meta.get("deletionTimestamp"):
                seen.discard(uid)
                continue
            self._tick(pod)
        for uid in list(self.pods):
            if uid not in seen and not self.pods[uid].stopping:
                self._terminate_async(self.pods[uid])

    # -- one pod ------------------------------------------------------------------------------------
    def _tick(self, pod: _Pod) -> None:
        now = time.monotonic()
        if pod.node is None and not self._schedule(pod):
            self._report(pod)
            return
        if pod.proc is None:
            if now >= pod.next_start:
                self._launch(pod)
        elif pod.proc.poll() is not None:
            self._exited(pod, pod.proc.returncode)
        elif now >= pod.next_probe:
            self._probe(pod)
        self._report(pod)

    def _schedule(self, pod: _Pod) -> bool:
        container = pod.obj["spec"]["containers"][0]
        limits = (container.get("resources") or {}).get("limits") or {}
        want = int(str(limits.get(GPU, "0")))
        node = next((n for n in self.nodes if n.gpus - n.used >= want), None)
        if node is None:
            free = sum(1 for n in self.nodes if n.gpus - n.used >= want)
            pod.scheduled_message = (
                f"{free}/{len(self.nodes)} nodes are available: {len(self.nodes) - free} Insufficient {GPU}."
            )
            return False
        node.used += want
        pod.node, pod.gpus, pod.scheduled_message = node, want, None
        return True

    def _launch(self, pod: _Pod) -> None:
        container = pod.obj["spec"]["containers"][0]
        image = self.images.get(S.image_repository(container.get("image", "")))
        if image is None:
            pod.waiting = (
                "ImagePullBackOff",
                f'Back-off pulling image "{container.get("image")}": not in the pod world\'s images',
            )
            pod.next_start = time.monotonic() + self.backoff_cap_s
            return
        if not pod.netns:
            pod.netns = f"etp-{pod.uid[:12]}"
            pod.ip = self.network.attach(pod.netns)
        pod_dir = self.root / "pods" / pod.uid
        try:
            plan = self._plan(pod, container, image, pod_dir)
        except S.NotSchedulable as exc:
            pod.waiting = ("ContainerCreating", str(exc))
            pod.next_start = time.monotonic() + 1.0
            return
        except S.ContainerConfigError as exc:
            pod.waiting = ("CreateContainerConfigError", str(exc))
            pod.next_start = time.monotonic() + 1.0
            return
        self._write_hosts(pod)
        for m in plan.mounts:
            self._ensure_mountpoint(Path(m.target))
        # a pod with no Secret, emptyDir or token mount has no directory yet
        pod_dir.mkdir(parents=True, exist_ok=True)
        pod.plan_path = pod_dir / "plan.json"
        pod.plan_path.write_text(
            json.dumps(
                {
                    "argv": plan.argv,
                    "env": plan.env,
                    "workdir": plan.workdir,
                    "binds": list(image.binds),
                    "mounts": [
                        {"source": str(m.source), "target": m.target, "read_only": m.read_only}
                        for m in plan.mounts
                    ],
                }
            ),
            encoding="utf-8",
        )
        log_path = pod_dir / "container.log"
        with log_path.open("ab") as out:
            out.write(f"--- start {pod.restarts}: {' '.join(plan.argv)}\n".encode())
            out.flush()
            pod.proc = subprocess.Popen(
                ["ip", "netns", "exec", pod.netns, sys.executable, "-m", "elastune_testing.podworld.init",
                 str(pod.plan_path)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )  # fmt: skip
        pod.started_at, pod.waiting, pod.ready, pod.startup_done = _now(), None, False, False
        pod.next_probe = time.monotonic() + 0.2
        log.info("pod %s/%s started at %s: %s", pod.namespace, pod.name, pod.ip, plan.argv)

    def _plan(self, pod: _Pod, container: dict[str, Any], image: S.Image, pod_dir: Path) -> S.LaunchPlan:
        def lookup(kind: str, ns: str, name: str) -> dict[str, Any] | None:
            read = {
                "Secret": self.core.read_namespaced_secret,
                "ConfigMap": self.core.read_namespaced_config_map,
                "PersistentVolumeClaim": self.core.read_namespaced_persistent_volume_claim,
            }[kind]
            try:
                return self.api.sanitize_for_serialization(read(name, ns))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        env = S.container_env(container, pod.obj, pod.ip, image, lookup)
        mounts = S.volumes_of(pod.obj, container, pod_dir, self.root / "pvc", lookup)
        spec = pod.obj["spec"]
        if self.apiserver is not None:
            env.setdefault("KUBERNETES_SERVICE_HOST", self.apiserver[0])
            env.setdefault("KUBERNETES_SERVICE_PORT", str(self.apiserver[1]))
        if self.service_account is not None and spec.get("automountServiceAccountToken", True):
            _, ca = self.service_account(pod.namespace)
            token = self._token(pod.namespace, spec.get("serviceAccountName") or "default")
            mounts.append(S.service_account_mount(pod_dir, token, ca, pod.namespace))
        if "PORT" not in env and container.get("ports"):
            pass  # Knative sets PORT in the template it gives the pod (see controllers)
        workdir = container.get("workingDir") or image.workdir  # the image's WORKDIR by default
        return S.LaunchPlan(S.argv_of(container, image, env), env, mounts, workdir)

    def _token(self, namespace: str, account: str) -> str:
        """The pod's service-account token, from a TokenRequest as a kubelet gets it (the API emulator
        then authorizes the pod's requests as that account, against the RBAC objects it stores)."""
        try:
            request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
            answer = self.core.create_namespaced_service_account_token(account, namespace, request)
        except ApiException as exc:  # kubelet: MountVolume.SetUp failed, the pod waits
            raise S.NotSchedulable(
                f"service account token for {namespace}/{account}: HTTP {exc.status}"
            ) from exc
        if answer.status is None:
            raise S.NotSchedulable(f"service account token for {namespace}/{account}: no token issued")
        return str(answer.status.token)

    def _ensure_mountpoint(self, target: Path) -> None:
        """Create a missing mount point on the host (the pod's mount namespace shares the host's
        directories) and remember it, so the world removes what it created."""
        if target.exists() or str(target).startswith("/tmp/"):
            return
        ancestor = target
        while not ancestor.exists():
            ancestor = ancestor.parent
        if os.path.realpath(ancestor) in SHADOWABLE:  # init.py makes it in the pod, over a private tmpfs
            return
        missing: list[Path] = []
        p = target
        while not p.exists():
            missing.append(p)
            p = p.parent
        target.mkdir(parents=True, exist_ok=True)
        self._created_dirs.extend(reversed(missing))

    def _write_hosts(self, pod: _Pod) -> None:
        d = Path("/etc/netns") / pod.netns
        d.mkdir(parents=True, exist_ok=True)
        text = f"127.0.0.1\tlocalhost\n{pod.ip}\t{pod.name}\n{self.hosts(pod.namespace)}"
        path = d / "hosts"
        # Rewrite in place: running pods have this very file (inode) bound over their /etc/hosts.
        with path.open("w", encoding="utf-8") as f:
            f.write(text)

    def refresh_hosts(self) -> None:
        for pod in list(self.pods.values()):
            if pod.netns and not pod.stopping:
                self._write_hosts(pod)

    def _exited(self, pod: _Pod, code: int) -> None:
        pod.proc = None
        reason = "Completed" if code == 0 else "Error"
        pod.last_terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": reason,
            "startedAt": pod.started_at,
            "finishedAt": _now(),
        }
        container = pod.obj["spec"]["containers"][0]
        if code != 0 and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            # No message file is mounted here, so it is always empty: the kubelet then takes the log's
            # tail, at most 80 lines and 2048 bytes (pkg/kubelet/kuberuntime/kuberuntime_container.go).
            tail = self.log_of(pod.namespace, pod.name).encode()[-2048:].decode(errors="replace")
            pod.last_terminated["message"] = "\n".join(tail.splitlines()[-80:])
        pod.ready = False
        policy = pod.obj["spec"].get("restartPolicy", "Always")
        if policy == "Never" or (policy == "OnFailure" and code == 0):
            pod.next_start = float("inf")
            return
        delay = min(self.backoff_cap_s, self.backoff_base_s * 2 ** min(pod.restarts, 10))
        pod.restarts += 1
        pod.next_start = time.monotonic() + delay
        pod.waiting = (
            "CrashLoopBackOff",
            f"back-off {delay:.0f}s restarting failed container={pod.obj['spec']['containers'][0]['name']}"
            f" pod={pod.name}",
        )
        log.info("pod %s/%s exited %d (restart %d in %.1fs)", pod.namespace, pod.name, code,
                 pod.restarts, delay)  # fmt: skip

    # -- probes -------------------------------------------------------------------------------------
    def _probe(self, pod: _Pod) -> None:
        container = pod.obj["spec"]["containers"][0]
        startup, readiness = container.get("startupProbe"), container.get("readinessProbe")
        probe = startup if (startup and not pod.startup_done) else readiness
        period = min(float((probe or {}).get("periodSeconds", 10)), PROBE_PERIOD_CAP_S)
        pod.next_probe = time.monotonic() + period
        if probe is None:
            pod.ready = True
            return
        ok = self._check(pod, container, probe)
        if probe is startup:
            pod.startup_done = ok
            pod.ready = ok and readiness is None
        else:
            pod.ready = ok

    def _check(self, pod: _Pod, container: dict[str, Any], probe: dict[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                port = _port(get.get("port"), container)
                url = f"http://{pod.ip}:{port}{get.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in probe:
                import socket

                with socket.create_connection(
                    (pod.ip, _port(probe["tcpSocket"]["port"], container)), timeout
                ):
                    return True
            if "exec" in probe and pod.proc is not None:
                plan = json.loads(pod.plan_path.read_text()) if pod.plan_path else {"env": {}}
                done = subprocess.run(
                    ["nsenter", "-t", str(pod.proc.pid), "-m", "-n", "--", *probe["exec"]["command"]],
                    env=plan["env"], capture_output=True, timeout=max(timeout, 3.0),
                )  # fmt: skip
                return done.returncode == 0
        except Exception:
            return False
        return False

    # -- status -------------------------------------------------------------------------------------
    def _report(self, pod: _Pod) -> None:
        status = self._status(pod)
        text = json.dumps(status, sort_keys=True)
        if text == pod.reported:
            return
        try:
            self.core.patch_namespaced_pod_status(
                pod.name, pod.namespace, {"status": status}, _preload_content=False
            )
            pod.reported = text
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _status(self, pod: _Pod) -> dict[str, Any]:
        container = pod.obj["spec"]["containers"][0]
        scheduled = pod.node is not None
        cond = [
            {"type": "PodScheduled", "status": "True" if scheduled else "False"}
            | ({} if scheduled else {"reason": "Unschedulable", "message": pod.scheduled_message or ""}),
            {"type": "ContainersReady", "status": str(pod.ready)},
            {"type": "Ready", "status": str(pod.ready)},
        ]
        if pod.proc is not None:
            state: dict[str, Any] = {"running": {"startedAt": pod.started_at}}
        elif pod.waiting is not None:
            state = {"waiting": {"reason": pod.waiting[0], "message": pod.waiting[1]}}
        elif pod.last_terminated is not None:
            state = {"terminated": pod.last_terminated}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        if pod.proc is not None:
            phase = "Running"
        elif pod.last_terminated is not None and pod.next_start == float("inf"):
            phase = "Succeeded" if pod.last_terminated["exitCode"] == 0 else "Failed"
        else:
            phase = "Running" if pod.restarts else "Pending"
        cs: dict[str, Any] = {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": f"podworld://{container.get('image', '')}",
            "containerID": f"podworld://{pod.uid}-{pod.restarts}" if pod.started_at else "",
            "ready": pod.ready,
            "started": pod.proc is not None,
            "restartCount": pod.restarts,
            "state": state,
        }
        if (pod.last_terminated is not None and pod.proc is not None) or pod.restarts:
            cs["lastState"] = {"terminated": pod.last_terminated} if pod.last_terminated else {}
        status: dict[str, Any] = {"phase": phase, "conditions": cond}
        if scheduled:
            status["containerStatuses"] = [cs]
            status["hostIP"] = self.network.node_ip
        if pod.ip:
            status["podIP"] = pod.ip
            status["podIPs"] = [{"ip": pod.ip}]
        return status

    # -- termination --------------------------------------------------------------------------------
    def _terminate_async(self, pod: _Pod, grace: float | None = None) -> threading.Thread:
        pod.stopping = True
        t = threading.Thread(target=self._terminate, args=(pod, grace), daemon=True)
        t.start()
        return t

    def _terminate(self, pod: _Pod, grace: float | None) -> None:
        if grace is None:
            grace = float(pod.obj["spec"].get("terminationGracePeriodSeconds", 30))
        proc = pod.proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.info("pod %s/%s: grace period over, SIGKILL", pod.namespace, pod.name)
            _signal_group(proc, signal.SIGKILL)  # whatever the container left behind in its group
            proc.wait()
        if pod.node is not None:
            pod.node.used -= pod.gpus
            pod.node = None
        if pod.netns:
            self.network.detach(pod.netns)
        self.pods.pop(pod.uid, None)
        log.info("pod %s/%s stopped", pod.namespace, pod.name)

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> None:
        """Fault injection: signal a running pod's processes (the container dies, the kubelet restarts
        it by its restartPolicy)."""
        for pod in self.pods.values():
            if pod.namespace == namespace and pod.name == name and pod.proc is not None:
                _signal_group(pod.proc, sig)
                return
        raise KeyError(f"no running pod {namespace}/{name}")

    def log_of(self, namespace: str, name: str) -> str:
        for pod in self.pods.values():
            if pod.namespace == namespace and pod.name == name:
                path = self.root / "pods" / pod.uid / "container.log"
                return path.read_text(errors="replace") if path.exists() else ""
        return ""


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _port(port: Any, container: Mapping[str, Any]) -> int:
    ports = container.get("ports") or []
    if port is None:
        return int(ports[0]["containerPort"]) if ports else 8080
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in ports:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")
