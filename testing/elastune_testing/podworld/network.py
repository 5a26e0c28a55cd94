"""Pod networking for the pod world: one bridge per world, one network namespace per pod.

Each pod gets a veth pair: the host end on the world's bridge, the pod end moved into the pod's
namespace as ``eth0`` with an address of its own in a /24 of 198.18.0.0/15 (RFC 2544 benchmarking
space: never routed, so it exists only inside the namespaces a test creates). The host holds the
bridge's ``.1`` (the "node": the API server's TLS front and every Service address live there as extra
addresses), so a pod reaches another pod only at that pod's address, and 127.0.0.1 inside a pod is the
pod's own loopback — exactly what a worker that advertises 127.0.0.1 meets on a cluster.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("elastune.podworld.net")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """Why the pod world cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the pod world needs root (network and mount namespaces); CI runs as root"
    probe = f"etprobe{os.getpid() % 100000}"
    try:
        ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot create a network namespace here: {exc}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass
class PodNetwork:
    """A bridge with the node's address; `attach()` gives a pod its namespace and address."""

    world_id: str
    subnet: ipaddress.IPv4Network = field(default_factory=lambda: _free_subnet())
    _next_pod: int = 10
    _next_service: int = 200
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _namespaces: set[str] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"etbr{self.world_id}"[:15]

    @property
    def node_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.node_ip}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        log.info("pod network %s on %s (node %s)", self.subnet, self.bridge, self.node_ip)

    def attach(self, netns: str) -> str:
        """Create network namespace ``netns`` with eth0 on the bridge; returns the pod's address."""
        with self._lock:
            if self._next_pod >= self._next_service:
                raise RuntimeError(f"pod network {self.subnet} is out of pod addresses")
            host_octet = self._next_pod
            self._next_pod += 1
        addr = str(self.subnet.network_address + host_octet)
        host_end = f"etv{self.world_id}{host_octet}"[:15]
        ip("netns", "add", netns)
        self._namespaces.add(netns)
        ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", host_end, "master", self.bridge, "up")
        ns = ("-n", netns)
        ip(*ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0")
        ip(*ns, "link", "set", "eth0", "up")
        ip(*ns, "link", "set", "lo", "up")
        ip(*ns, "route", "add", "default", "via", self.node_ip)
        return addr

    def detach(self, netns: str) -> None:
        """Delete the pod's namespace (its veth pair goes with it)."""
        if netns in self._namespaces:
            ip("netns", "del", netns, check=False)
            self._namespaces.discard(netns)
            hosts = Path("/etc/netns") / netns
            if hosts.is_dir():
                for f in hosts.iterdir():
                    f.unlink(missing_ok=True)
                hosts.rmdir()

    def service_address(self) -> str:
        """A stable address on the node for a Service (its clusterIP)."""
        with self._lock:
            octet = self._next_service
            if octet > 254:
                raise RuntimeError(f"pod network {self.subnet} is out of Service addresses")
            self._next_service += 1
        addr = str(self.subnet.network_address + octet)
        ip("addr", "add", f"{addr}/32", "dev", self.bridge)
        return addr

    def destroy(self) -> None:
        for netns in list(self._namespaces):
            self.detach(netns)
        ip("link", "del", self.bridge, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no interface of this host uses (worlds of parallel runs differ)."""
    used = ip("-4", "-o", "addr", "show").stdout
    base = ipaddress.IPv4Network("198.18.0.0/15")
    start = os.getpid() % 512
    subnets = list(base.subnets(new_prefix=24))
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if f" {candidate.network_address + 1}/" not in used:
            return candidate
    raise RuntimeError("no free /24 in 198.18.0.0/15 for a pod network")
