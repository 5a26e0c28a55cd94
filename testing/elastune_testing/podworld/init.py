"""A pod's first process: sets up its mount namespace, then becomes the container's command.

Started by the kubelet as ``ip netns exec <pod-netns> python -m elastune_testing.podworld.init PLAN``:
``ip netns exec`` has already given it the pod's network namespace and a mount namespace of its own
(slave to the host's, so nothing mounted here leaks out) with the pod's /etc/hosts bound over the
host's. Here: a private tmpfs on /tmp, the image's read-only paths, the declared volumes, then
``execvpe`` of the container's argv with exactly the plan's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from elastune_testing.podworld.spec import SHADOWABLE


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        plan = json.load(f)
    # Sources may lie under the host's /tmp (a test's tmp_path), which the private /tmp hides: hold each
    # open first and bind it through /proc/<pid>/fd (the descriptors are not inherited by the exec).
    held = {p: os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in plan["binds"]}
    shadowed: set[str] = set()
    held |= {m["source"]: os.open(m["source"], os.O_RDONLY | os.O_DIRECTORY) for m in plan["mounts"]}

    def make_mountpoint(target: str) -> None:
        """Create a missing mount point inside the pod only: the first existing ancestor, when it is a
        directory a container never shares with its host (/mnt, /run, ...), gets a tmpfs of its own
        first, so nothing is created on the host (where other pods would see it)."""
        ancestor = target
        while not os.path.exists(ancestor):
            ancestor = os.path.dirname(ancestor)
        real = os.path.realpath(ancestor)
        if ancestor != target and real in SHADOWABLE and real not in shadowed:
            _mount("-t", "tmpfs", "-o", "mode=755,size=16m", "tmpfs", real)
            shadowed.add(real)
        os.makedirs(target, exist_ok=True)

    def bind(source: str, target: str, read_only: bool) -> None:
        make_mountpoint(target)
        # --no-canonicalize: mount(8) would resolve the /proc link to its path string, which inside this
        # namespace may name the new empty mount point (a source under /tmp bound at the same path).
        _mount("--bind", "--no-canonicalize", f"/proc/{os.getpid()}/fd/{held[source]}", target)
        if read_only:
            _mount("-o", "remount,bind,ro", target)

    _mount("-t", "tmpfs", "-o", "mode=1777,size=512m", "tmpfs", "/tmp")
    # A container's /mnt is its image's (empty), never the node's.
    _mount("-t", "tmpfs", "-o", "mode=755,size=16m", "tmpfs", "/mnt")
    shadowed.add("/mnt")
    for m in sorted(plan["mounts"], key=lambda m: m["target"].count("/")):
        bind(m["source"], m["target"], m["read_only"])
    # Paths the image carries (venv, checkout, model cache) are read-only in the pod and stay visible
    # over the volumes: here they lie where the host keeps them, possibly under /tmp, where a pod often
    # mounts an emptyDir (the chart's operator does) that would hide them, unlike a real image's files.
    for path in plan["binds"]:
        bind(path, path, True)
    os.chdir(plan["workdir"])
    argv = plan["argv"]
    try:
        os.execvpe(argv[0], argv, plan["env"])
    except OSError as exc:  # the runtime's "executable file not found": exit like a failed container
        print(f"exec {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        sys.exit(127)


if __name__ == "__main__":
    main()
