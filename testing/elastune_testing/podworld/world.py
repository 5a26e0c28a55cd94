"""A pod world: the API emulator, a pod network, a kubelet and the controllers, in one object.

    with PodWorld.start(tmp_path) as world:
        world.helm_install()                      # operator, gateway, Redis pods from `helm template`
        world.apply(warm_pool_manifest)           # kubectl apply
        world.wait_ready("elastune-system", "app.kubernetes.io/component=gateway")

The test process is the node: it holds the bridge's first address, where the API server's TLS front
(in-cluster config for pods: KUBERNETES_SERVICE_HOST, a service-account token and the front's CA at
the usual path) and every Service address live. Images map to environments of this host (`images()`):
the operator and worker images run this checkout's `elastune` with this interpreter; Redis runs
Debian's redis-server. Stand-ins, named as such: the TLS front accepts any token (the emulator has no
RBAC); Service names resolve through each pod's /etc/hosts, not DNS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from elastune_testing.emulator import EmulatorHandle, start_emulator
from elastune_testing.nodes import add_gpu_node, remove_node
from elastune_testing.podworld import network as N
from elastune_testing.podworld.controllers import Deployments, KnativeServices, Services
from elastune_testing.podworld.jobs import Jobs
from elastune_testing.podworld.kubelet import Kubelet, Node
from elastune_testing.podworld.spec import Image

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "elastune"
RELEASE_NAMESPACE = "elastune-system"
OPERATOR_IMAGE = "ghcr.io/elastune/operator"
WORKER_IMAGE = "ghcr.io/elastune/worker"
REDIS_IMAGE = "docker.io/library/redis"
APISERVER_PORT = 6443


def images(cache_root: Path) -> dict[str, Image]:
    """The images the chart and the WarmPools name, as environments of this host."""
    venv_bin = str(Path(sys.executable).parent)
    path = f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    carried = tuple(sorted({str(REPO), sys.prefix, str(Path(sys.executable).resolve().parents[1]),
                            str(cache_root)}))  # fmt: skip
    base = {"PATH": path, "HOME": "/tmp", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    worker_env = {**base, "ELASTUNE_CACHE": str(cache_root), "HF_HUB_OFFLINE": "1",
                  "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # fmt: skip
    return {
        # docker/operator.Dockerfile: ENTRYPOINT ["elastune"], CMD ["operator"]
        OPERATOR_IMAGE: Image(("elastune",), ("operator",), base, carried),
        # docker/worker.Dockerfile: ENTRYPOINT ["python", "-m", "elastune_worker"], CMD ["serve"]; WORKDIR
        # /app holds a copy of manifests/data/ as data/ (relative datasets of manifests/ resolve there).
        WORKER_IMAGE: Image(
            ("python", "-m", "elastune_worker"),
            ("serve",),
            worker_env,
            carried,
            workdir=str(REPO / "manifests"),
        ),
        REDIS_IMAGE: Image(("redis-server",), (), {"PATH": path}, ()),
    }


@dataclass
class PodWorld:
    root: Path
    emulator: EmulatorHandle
    network: N.PodNetwork
    api: client.ApiClient
    kubelet: Kubelet
    services: Services
    deployments: Deployments
    knative: KnativeServices
    _front_stop: Callable[[], None] = lambda: None
    jobs: Jobs | None = None

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def start(cls, root: Path, *, gpu_nodes: int = 2, gpus_per_node: int = 1,
              cache_root: Path | None = None) -> PodWorld:  # fmt: skip
        why = N.available()
        if why is not None:
            raise RuntimeError(why)
        if cache_root is None:
            from elastune_demo.build import cache_root as default_cache

            cache_root = default_cache()
        root.mkdir(parents=True, exist_ok=True)
        cache_root.mkdir(parents=True, exist_ok=True)
        stops: list[Callable[[], None]] = []
        try:
            emulator = start_emulator(root / "emulator")
            stops.append(emulator.stop)
            net = N.PodNetwork(secrets.token_hex(2))
            net.create()
            stops.append(net.destroy)
            api = config.new_client_from_config(str(emulator.kubeconfig_path))
            cert, key = _self_signed(root / "tls", net.node_ip)
            ca_pem = cert.read_text()
            nodes = [Node(f"gpu-node-{i}", gpus_per_node) for i in range(gpu_nodes)]
            nodes.append(Node("cpu-node", 0))
            for n in nodes:  # the Node objects the operator counts its cold pool from (node_capacity)
                add_gpu_node(api, n.name, n.gpus, labels=None if n.gpus else {})
            kubelet = Kubelet(
                api, net, images(cache_root), root / "kubelet", nodes,
                service_account=lambda ns: (f"podworld-token-{ns}", ca_pem),
                apiserver=(net.node_ip, APISERVER_PORT),
            )  # fmt: skip
            services = Services(api, kubelet, net, on_change=kubelet.refresh_hosts)
            kubelet.hosts = services.hosts
            front = _tls_front(services.loop, net.node_ip, APISERVER_PORT, emulator.url, cert, key)
            stops.append(front)
            world = cls(root, emulator, net, api, kubelet, services, Deployments(api), KnativeServices(api))
            world._front_stop = front
            world.jobs = Jobs(api)
            for part in (services, world.deployments, world.knative, world.jobs, kubelet):
                part.start()
            return world
        except BaseException:
            for stop in reversed(stops):
                stop()
            raise

    def stop(self) -> None:
        # Controllers first (nothing new starts), then pods, then the proxies, network and API.
        parts = [
            *([self.jobs.stop] if self.jobs else []),
            self.knative.stop,
            self.deployments.stop,
            self.kubelet.stop,
            self._front_stop,
            self.services.stop,
        ]
        for stop in parts:
            with contextlib.suppress(Exception):  # tear down the rest whatever one part says
                stop()
        self.network.destroy()
        self.emulator.stop()

    def add_node(self, name: str, gpus: int) -> None:
        """A GPU node of the cold pool joins: its Node object appears and the kubelet schedules on it."""
        add_gpu_node(self.api, name, gpus)
        self.kubelet.nodes = [*self.kubelet.nodes, Node(name, gpus)]  # replaced whole: read by its thread

    def remove_node(self, name: str) -> None:
        """A node leaves: no new pod lands on it and its Node object goes. Pods already on it keep
        running here (on a cluster the pod garbage collector removes them later)."""
        self.kubelet.nodes = [n for n in self.kubelet.nodes if n.name != name]
        remove_node(self.api, name)

    def __enter__(self) -> PodWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- kubectl ------------------------------------------------------------------------------------
    def apply(self, docs: Iterable[dict[str, Any]] | dict[str, Any], namespace: str = "default") -> None:
        """Create each object (or replace its spec when it exists), like `kubectl apply`."""
        for doc in [docs] if isinstance(docs, dict) else docs:
            if doc:
                apply_object(self.api, doc, namespace)

    def helm_install(
        self, *sets: str, strings: tuple[str, ...] = (), release: str = "elastune"
    ) -> list[dict[str, Any]]:
        """`helm template` of the chart, applied: the operator, gateway and Redis pods start from it."""
        from elastune_testing.podworld.helm import template

        docs = template(release, RELEASE_NAMESPACE, *sets, strings=strings)
        self.apply(docs, RELEASE_NAMESPACE)
        return docs

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        core = client.CoreV1Api(self.api)
        resp: Any = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return json.loads(resp.data)["items"]

    def wait_ready(
        self, namespace: str, selector: str, count: int = 1, timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            pods = self.pods(namespace, selector)
            ready = [p for p in pods if _ready(p)]
            if len(ready) >= count:
                return ready
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p['metadata']['name']}: {json.dumps(p.get('status'))}\n"
                    + self.kubelet.log_of(namespace, p["metadata"]["name"])[-3000:]
                    for p in pods
                )
                raise TimeoutError(f"{count} ready pods of {namespace}/{selector} within {timeout} s\n{logs}")
            time.sleep(0.3)

    def service_url(self, namespace: str, name: str, port: int) -> str:
        """The Service's address as a pod (or this node) reaches it."""
        deadline = time.monotonic() + 30
        while (namespace, name) not in self.services.addresses:
            if time.monotonic() > deadline:
                raise TimeoutError(f"service {namespace}/{name} got no address")
            time.sleep(0.2)
        return f"http://{self.services.addresses[(namespace, name)]}:{port}"

    def run_in_pod_network(self, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command from a fresh pod's network namespace (a client pod of its own)."""
        netns = f"etc-{secrets.token_hex(4)}"
        self.network.attach(netns)
        try:
            return subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True,
                                  text=True, timeout=timeout)  # fmt: skip
        finally:
            self.network.detach(netns)


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


_CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "ClusterKopfPeering"}  # fmt: skip


def _plural(kind: str) -> str:
    lower = kind.lower()
    if lower.endswith("s"):
        return lower + "es"
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + "s"


def apply_object(api: client.ApiClient, doc: dict[str, Any], namespace: str = "default") -> None:
    """POST the object, or merge-patch it when it exists (raw JSON: any kind the emulator serves)."""
    group_version, kind = doc["apiVersion"], doc["kind"]
    prefix = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    meta = doc.setdefault("metadata", {})
    if kind in _CLUSTER_KINDS:
        base = f"{prefix}/{_plural(kind)}"
    else:
        ns = meta.setdefault("namespace", namespace)
        base = f"{prefix}/namespaces/{ns}/{_plural(kind)}"
    host = api.configuration.host
    code, body = _http("POST", f"{host}{base}", doc, "application/json")
    if code == 409:
        patch = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "status")}
        code, body = _http("PATCH", f"{host}{base}/{meta['name']}", patch, "application/merge-patch+json")
    if code >= 300:
        raise RuntimeError(f"apply {kind} {meta.get('name')}: HTTP {code}: {body[:500]}")


def _http(method: str, url: str, doc: Any, content_type: str) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(doc).encode(), method=method,
                                 headers={"Content-Type": content_type})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _self_signed(directory: Path, ip: str) -> tuple[Path, Path]:
    """A CA-less self-signed serving certificate for the API server's TLS front (pods trust it as
    their ca.crt)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "apiserver.crt", directory / "apiserver.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=kubernetes",
         "-addext", f"subjectAltName=IP:{ip},DNS:kubernetes,DNS:kubernetes.default.svc",
         "-addext", "basicConstraints=critical,CA:TRUE"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def _tls_front(
    loop: asyncio.AbstractEventLoop, host: str, port: int, upstream: str, cert: Path, key: Path
) -> Callable[[], None]:
    """TLS on the node's address, plain HTTP to the emulator on loopback."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    up_host, up_port = upstream.rsplit("://", 1)[1].rsplit(":", 1)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from elastune_testing.podworld.controllers import _copy

        try:
            up_r, up_w = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_copy(reader, up_w), _copy(up_r, writer), return_exceptions=True)

    async def start() -> asyncio.AbstractServer:
        return await asyncio.start_server(handle, host, port, ssl=ctx)

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)

    def stop() -> None:
        loop.call_soon_threadsafe(server.close)

    return stop


__all__ = ["PodWorld", "apply_object", "images"]
