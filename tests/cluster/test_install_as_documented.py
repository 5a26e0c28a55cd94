"""The quick start (docs/getting-started/cluster.md) as a user runs it, in the pod world.

The page's ``bash`` blocks are read and run in order, so the docs cannot drift from what works: the chart
rendered with exactly the page's ``helm install --set`` values, the files its ``kubectl apply -f`` names,
the API key Secret it creates, and its ``curl`` run as written (the port-forward's localhost address
mapped to the gateway Service's). A command this test does not know fails it: a step the docs add must
be taught here, so no step goes untested. The one stand-in: the pod world has no storage classes, so the
page's ``STORAGE_CLASS`` names one nothing checks (the claim must exist; the kubelet keeps a pod that
mounts a missing claim waiting, as a real one does).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from conftest import RELEASE_NAMESPACE, chart_world
from elastune_testing.podworld import PodWorld

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "getting-started" / "cluster.md"
JOB_TIMEOUT_S = 150.0
"""Cap on the page's `kubectl wait` (15 minutes on a cluster): the tiny GPT-2 job takes well under it here."""


def commands(markdown: str) -> list[str]:
    """The page's shell commands: each ```bash block, continuation lines joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#[^'\"]*$", "", line).strip()  # a trailing comment (no quotes in it)
            if line and not line.startswith("#"):
                out.append(line)
    return out


@dataclass
class User:
    """Runs the quick start's commands against a pod world (one method per command it knows)."""

    world: PodWorld | None = None
    env: dict[str, str] = field(default_factory=dict)
    forwards: dict[str, str] = field(default_factory=dict)  # localhost:PORT -> the Service's address
    outputs: list[str] = field(default_factory=list)
    started: Callable[[tuple[str, ...]], PodWorld] | None = None

    def expand(self, word: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.env.get(m.group(1), ""), word)

    def run(self, command: str) -> None:
        words = shlex.split(command.removesuffix(" &"))
        if words[0] == "export":
            self.export(command.removeprefix("export "))
        elif words[:2] == ["helm", "install"]:
            self.helm_install([self.expand(w) for w in words[2:]])
        elif words[0] == "kubectl":
            self.kubectl([self.expand(w) for w in words[1:]])
        elif words[0] == "curl":
            self.curl(command)
        else:
            raise AssertionError(f"{PAGE.name} runs a command this test does not: {command}")

    def export(self, assignment: str) -> None:
        # As the user's shell evaluates it (command substitution included: `openssl rand`).
        name = assignment.split("=", 1)[0]
        script = f'export {assignment}; printf %s "${name}"'
        value = subprocess.run(["bash", "-c", script], env={**os.environ, **self.env}, check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
        for local, remote in self.forwards.items():
            value = value.replace(f"http://{local}", remote)
        self.env[name] = value

    def helm_install(self, args: list[str]) -> None:
        release, chart, *flags = args
        assert (release, chart) == ("elastune", "helm/elastune"), args
        sets: list[str] = []
        namespace = "default"
        while flags:
            flag = flags.pop(0)
            if flag in ("--namespace", "-n"):
                namespace = flags.pop(0)
            elif flag == "--set":
                sets.append(flags.pop(0))
            elif flag != "--create-namespace":
                raise AssertionError(f"helm install flag this test does not pass on: {flag}")
        assert namespace == RELEASE_NAMESPACE, namespace
        assert self.started is not None
        self.world = self.started(tuple(sets))

    def kubectl(self, args: list[str]) -> None:
        namespace = "default"
        if args[0] in ("-n", "--namespace"):
            namespace, args = args[1], args[2:]
        verb, rest = args[0], args[1:]
        assert self.world is not None, "a kubectl command before the chart is installed"
        handler = {
            "apply": self.apply,
            "rollout": self.rollout,
            "get": self.get,
            "wait": self.wait,
            "create": self.create,
            "label": self.label,
            "port-forward": self.port_forward,
        }.get(verb)
        assert handler is not None, f"kubectl {verb}: a command this test does not know"
        handler(namespace, rest)

    def apply(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None
        files = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
        assert files and len(files) * 2 == len(args), args
        for name in files:
            docs = [d for d in yaml.safe_load_all((REPO / name).read_text(encoding="utf-8")) if d]
            self.world.apply(docs, namespace)

    def rollout(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None and args[0] == "status", args
        kind, name = args[1].split("/")
        assert kind == "deployment", args
        deployment = client.AppsV1Api(self.world.api).read_namespaced_deployment(name, namespace)
        labels = deployment.spec.selector.match_labels or {}
        self.world.wait_ready(namespace, ",".join(f"{k}={v}" for k, v in labels.items()), timeout=120)

    def get(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None and args[0] == "pvc", args
        # The claim exists (the kubelet would keep the pool's pods waiting otherwise).
        client.CoreV1Api(self.world.api).read_namespaced_persistent_volume_claim(args[1], namespace)

    def wait(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None
        kind, name = args[0].split("/")
        (condition,) = [a.removeprefix("--for=condition=") for a in args if a.startswith("--for=condition=")]
        custom = client.CustomObjectsApi(self.world.api)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            obj: Any = custom.get_namespaced_custom_object(
                "elastune.dev", "v1alpha1", namespace, kind + "s", name
            )
            conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
            if conditions.get(condition, {}).get("status") == "True":
                return
            failed = conditions.get("Failed", {}).get("status") == "True"
            assert not failed and time.monotonic() < deadline, (
                f"{kind}/{name} never {condition}: {json.dumps(obj.get('status'))}\n"
                + self.worker_logs(namespace)
            )
            time.sleep(1)

    def create(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None and args[:2] == ["secret", "generic"], args
        literals = dict(a.removeprefix("--from-literal=").split("=", 1) for a in args[3:])
        assert len(literals) == len(args) - 3, f"only --from-literal is known: {args}"
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": args[2], "namespace": namespace},
                  "stringData": literals}  # fmt: skip
        self.world.apply(secret, namespace)

    def label(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None and args[0] == "secret", args
        labels = dict(a.split("=", 1) for a in args[2:])
        client.CoreV1Api(self.world.api).patch_namespaced_secret(
            args[1], namespace, {"metadata": {"labels": labels}}
        )

    def port_forward(self, namespace: str, args: list[str]) -> None:
        assert self.world is not None
        kind, name = args[0].split("/")
        assert kind == "svc", args
        local, _, remote = args[1].partition(":")
        self.forwards[f"localhost:{local}"] = self.world.service_url(namespace, name, int(remote or local))

    def curl(self, command: str) -> None:
        # The page's curl as written, by bash, with the page's variables; only the port-forward's
        # localhost address is the Service's (export maps it).
        done = subprocess.run(["bash", "-c", command], env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=180)  # fmt: skip
        assert done.returncode == 0, f"curl exited {done.returncode}: {done.stderr}\n{done.stdout}"
        self.outputs.append(done.stdout)

    def worker_logs(self, namespace: str) -> str:
        assert self.world is not None
        out = []
        for pod in self.world.pods(namespace):  # a pod waiting on a missing claim has no log: its status
            name, status = pod["metadata"]["name"], pod.get("status") or {}
            waiting = [
                c["state"]["waiting"]
                for c in status.get("containerStatuses") or []
                if "waiting" in c["state"]
            ]
            out.append(
                f"--- {name} {status.get('phase')} {waiting}\n"
                + self.world.kubelet.log_of(namespace, name)[-2000:]
            )
        return "\n".join(out)


def test_the_quick_start_as_written_tunes_a_prompt_and_answers_a_completion(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from elastune_demo.build import ensure_tiny_model

    ensure_tiny_model()  # the worker image carries the tiny GPT-2 (docker/worker.Dockerfile)
    steps = commands(PAGE.read_text(encoding="utf-8"))
    assert any(s.startswith("helm install") for s in steps) and any(s.startswith("curl") for s in steps)
    root = tmp_path_factory.mktemp("install")
    with ExitStack() as stack:
        # The pod world starts with the chart when the page's `helm install` runs.
        user = User(started=lambda sets: stack.enter_context(chart_world(root, *sets)))
        for step in steps:
            user.run(step)
        world = user.world
        assert world is not None
        # The completion came from a worker pod of the page's WarmPool.
        (answer,) = user.outputs
        body = json.loads(answer)
        assert body["choices"][0]["text"], body
        assert world.pods("default", "elastune.dev/warmpool=tiny-gpt2"), "no worker pod answered"
        # The job's artifact is on the claim the chart created, which outlives the pods.
        custom = client.CustomObjectsApi(world.api)
        job: Any = custom.get_namespaced_custom_object(
            "elastune.dev", "v1alpha1", "default", "tuningjobs", "book-author"
        )
        uri = job["status"]["artifactURI"]
        assert uri.startswith("pvc://elastune-artifacts/"), uri
        on_claim = world.root / "kubelet" / "pvc" / "default" / "elastune-artifacts"
        assert (on_claim / uri.removeprefix("pvc://elastune-artifacts/") / "adapter_config.json").is_file()
