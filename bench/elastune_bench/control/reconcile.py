"""`elastune bench operator`: N TuningJobs created at once against the Kubernetes API emulator.

The real operator process (kopf) runs against the emulator over HTTP with a real redis-server; no
workers (jobs wait for warm GPUs), so what is measured is the reconcile path: from the create call
being sent to the job's status carrying the operator's ``Accepted`` condition. Prints p50/p99/max of
that latency, the time until every job was accepted, and handler errors (the operator's
``elastune_handler_errors_total`` plus tracebacks in its log).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elastune_common.servers import free_port, start_redis
from elastune_contract.api.constants import GROUP, VERSION

NS = "default"


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def run(jobs: int, json_path: Path | None, timeout: float) -> dict[str, Any]:
    from kubernetes import client, config, watch

    from elastune_testing.emulator import start_emulator

    tmp = Path(tempfile.mkdtemp(prefix="elastune-bench-operator-"))
    redis = start_redis(tmp / "redis")
    # Its own process: the emulator must not share this process's GIL with the client threads. No Node
    # objects: the cold pool has no GPUs, nothing runs; the benchmark is about reconciling.
    emulator = start_emulator(tmp / "emulator", subprocess_mode=True)
    api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(emulator.kubeconfig_path)))
    metrics_port = free_port()
    env = {
        **os.environ,
        "KUBECONFIG": str(emulator.kubeconfig_path),
        "ELASTUNE_REDIS_URL": redis.url,
        "ELASTUNE_REDIS_SECRET": "",
        "ELASTUNE_WORK_DIR": str(tmp / "work"),
        "ELASTUNE_METRICS_PORT": str(metrics_port),
    }
    log_path = tmp / "operator.log"
    cmd = [sys.executable, "-m", "elastune_cli", "operator", "--standalone", "--all-namespaces"]
    operator = subprocess.Popen(cmd, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    try:
        pool = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WarmPool",
            "metadata": {"name": "bench", "namespace": NS},
            # A jobStorage claim: without one the jobs (no output.uri) are refused as OutputNotDurable.
            "spec": {
                "model": "bench/model",
                "maxWarmGPUs": 8,
                "volumes": [{"claimName": "bench", "jobStorage": True}],
            },
        }
        api.create_namespaced_custom_object(GROUP, VERSION, NS, "warmpools", pool)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the operator is up once it reported the pool's status
            got = api.get_namespaced_custom_object(GROUP, VERSION, NS, "warmpools", "bench")
            if got.get("status"):
                break
            if operator.poll() is not None:
                raise RuntimeError(f"the operator exited:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the operator did not start:\n{log_path.read_text()[-3000:]}")

        created: dict[str, float] = {}
        accepted: dict[str, float] = {}
        stop = threading.Event()

        def watch_status() -> None:
            # A watch sees each status write as it lands (polling lists would load the apiserver).
            w = watch.Watch()
            while not stop.is_set():
                for ev in w.stream(
                    api.list_namespaced_custom_object, GROUP, VERSION, NS, "tuningjobs", timeout_seconds=5
                ):
                    obj = ev["object"]
                    name = obj["metadata"]["name"]
                    conds = (obj.get("status") or {}).get("conditions", [])
                    if name not in accepted and any(c["type"] == "Accepted" for c in conds):
                        accepted[name] = time.monotonic()
                    if stop.is_set():
                        break

        watcher = threading.Thread(target=watch_status, daemon=True)
        watcher.start()
        time.sleep(0.5)

        def create(i: int) -> None:
            name = f"job-{i:04d}"
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "TuningJob",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "model": "bench/model",
                    "dataset": "/data/train.jsonl",
                    "termination": {"maxIterations": 100},
                    "deadline": f"{10 + i % 50}m",
                },
            }
            created[name] = time.monotonic()
            api.create_namespaced_custom_object(GROUP, VERSION, NS, "tuningjobs", body)

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool_exec:
            list(pool_exec.map(create, range(jobs)))
        create_s = time.monotonic() - t0
        end = time.monotonic() + timeout
        while len(accepted) < jobs and time.monotonic() < end:
            time.sleep(0.1)
        stop.set()
        latencies = [accepted[n] - created[n] for n in accepted if n in created]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        handler_errors = sum(
            float(m.group(1))
            for m in re.finditer(r"^elastune_handler_errors_total\{[^}]*\} (\S+)$", text, re.M)
        )
        log_text = log_path.read_text(errors="replace")
        tracebacks = log_text.count("Traceback")
        kopf_failures = len(re.findall(r"Handler '[^']+' failed", log_text))
        result = {
            "jobs": jobs,
            "accepted": len(accepted),
            "create_seconds": round(create_s, 3),
            "all_accepted_seconds": round(max(accepted.values()) - t0, 3) if accepted else None,
            "reconcile_latency_s": {
                "p50": round(_percentile(latencies, 50), 4),
                "p99": round(_percentile(latencies, 99), 4),
                "max": round(max(latencies), 4) if latencies else None,
            },
            "handler_errors": int(handler_errors),
            "kopf_handler_failures": kopf_failures,
            "tracebacks_in_log": tracebacks,
        }
    finally:
        operator.terminate()
        try:
            operator.wait(15)
        except subprocess.TimeoutExpired:
            operator.kill()
        emulator.stop()
        redis.stop()
    lat = result["reconcile_latency_s"]
    print(f"{jobs} TuningJobs created at once against the emulator ({result['create_seconds']} s to create)")
    print(
        f"accepted: {result['accepted']}/{jobs}, "
        f"all within {result['all_accepted_seconds']} s of the first create"
    )
    print(
        "reconcile latency (create -> Accepted in status): "
        f"p50 {lat['p50']} s, p99 {lat['p99']} s, max {lat['max']} s"
    )
    print(
        f"handler errors: {result['handler_errors']} (metric), kopf handler failures {kopf_failures}, "
        f"tracebacks {tracebacks}"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench operator", description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--json", type=Path, metavar="PATH")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every job's status")
    args = p.parse_args(argv)
    result = run(args.jobs, args.json, args.timeout)
    ok = (
        result["accepted"] == args.jobs
        and result["handler_errors"] == 0
        and result["kopf_handler_failures"] == 0
    )
    return 0 if ok else 1
