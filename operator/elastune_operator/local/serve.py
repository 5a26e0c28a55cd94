"""`elastune serve -f manifests/...`: serving on one machine, no cluster, no GPU (issue 15).

The same pieces as on Kubernetes, as local processes: an embedded redis-server (the registry), local
CPU worker processes as each WarmPool (engine flags from its serving section), the control core (the
PromptTuner scheduler, serving need, adapter placement and status) and the gateway on localhost. The
LoRAAdapters in the files are validated and placed; TuningJobs are tuned, and those with
``spec.output.publish`` are served under that name when they succeed (tune -> serve). It prints the
OpenAI base URL and runs until Ctrl-C; status of every resource goes to <state-dir>/status/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from elastune_common.bus import BusUnreachable
from elastune_common.servers import Server, ServerError, free_port
from elastune_contract.api import manifests
from elastune_contract.api.loraadapter import LoRAAdapter
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.request_credential import KEY_FILE_ENV
from elastune_operator.api_keys import namespace_models
from elastune_operator.control.core import ControlCore
from elastune_operator.control.records import CoreSettings, JobRecord
from elastune_operator.control.resources import artifact_dir, job_record, pool_config, worker_serving_args
from elastune_operator.control.serving import AdapterRecord
from elastune_operator.local import s3_secrets
from elastune_operator.local.api_keys import KeyFileError, LocalKeys
from elastune_operator.local.backend import LocalBackend
from elastune_operator.local.rounds import Rounds
from elastune_operator.local.run import (
    RunError,
    connect_bus,
    forget_embedded_password,
    install_stop,
    resolve_dataset,
    restart_redis,
)
from elastune_operator.local.supervise import Backoff

KEYS_REREAD_S = 2.0
"""How often the -f files are read again for API key Secrets (revocation within seconds)."""
GATEWAY_METRICS_FILE = "gateway-metrics-url"
"""In the state directory: where the gateway's /metrics is (its own port, not the client one)."""


@dataclass
class ServeOptions:
    files: list[Path]
    port: int = 8000
    workers: int = 2
    state_dir: Path = Path(".elastune")
    redis_url: str | None = None
    timeout: float | None = None
    """Stop after this many seconds (tests, demos); None: until Ctrl-C."""


def _manifest_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for path in paths:
        files += sorted(p for p in path.glob("*.yaml")) if path.is_dir() else [path]
    return files


def load(
    opts: ServeOptions,
) -> tuple[list[WarmPool], list[tuple[TuningJob, Path]], list[tuple[LoRAAdapter, Path]]]:
    try:
        found = manifests.load(_manifest_files(opts.files))
    except (OSError, yaml.YAMLError) as exc:
        raise RunError(f"cannot read manifests: {exc}") from exc
    bad = [m for m in found if m.problems]
    if bad:
        raise RunError(
            "\n".join(f"{m.file}: {m.name}: invalid" + "".join(f"\n  {p}" for p in m.problems) for m in bad)
        )
    pools = [m.resource for m in found if isinstance(m.resource, WarmPool)]
    if not pools:
        raise RunError(f"no WarmPool in {', '.join(map(str, opts.files))}: serving needs one per model")
    jobs = [(m.resource, m.file.resolve().parent) for m in found if isinstance(m.resource, TuningJob)]
    adapters = [(m.resource, m.file.resolve().parent) for m in found if isinstance(m.resource, LoRAAdapter)]
    return pools, jobs, adapters


class _StatusFiles:
    """Each resource's status as the operator would write it, under <state-dir>/status/, and one line
    on the terminal when an adapter's conditions change."""

    def __init__(self, root: Path, err: TextIO) -> None:
        self.root = root / "status"
        self.root.mkdir(parents=True, exist_ok=True)
        self.err = err
        self._lines: dict[str, str] = {}

    def adapter(self, rec: AdapterRecord) -> None:
        doc = {
            "apiVersion": "elastune.dev/v1alpha1",
            "kind": "LoRAAdapter",
            "metadata": {"name": rec.name, "namespace": rec.namespace},
            "spec": rec.spec.model_dump(mode="json", by_alias=True, exclude_none=True),
            "status": rec.status.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
        (self.root / f"loraadapter-{rec.namespace}-{rec.name}.yaml").write_text(
            yaml.safe_dump(doc, sort_keys=False)
        )
        conds = {c.type: c for c in rec.status.conditions}
        line = "  ".join(f"{t}={c.status} ({c.reason})" for t, c in sorted(conds.items()))
        if self._lines.get(rec.key) != line:
            self._lines[rec.key] = line
            print(f"LoRAAdapter {rec.key}: {line}", file=self.err, flush=True)

    def job(self, job: JobRecord) -> None:
        doc = {
            "kind": "TuningJob",
            "metadata": {"name": job.key},
            "status": job.status.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
        (self.root / f"tuningjob-{job.key.replace('/', '-')}.yaml").write_text(
            yaml.safe_dump(doc, sort_keys=False)
        )


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunError(f"the gateway exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RunError(f"the gateway did not answer on {url} within {timeout:g} s")


def serve(opts: ServeOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    pools, jobs, adapters = load(opts)
    state_dir = opts.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    status = _StatusFiles(state_dir, err)
    servers: list[Server] = []
    backend: LocalBackend | None = None
    gateway: subprocess.Popen[bytes] | None = None
    tmp = Path(tempfile.mkdtemp(prefix="servers-", dir=state_dir))
    # Before anything starts: a SIGTERM during start-up must reach the clean-up below (the servers,
    # the gateway and the workers run in sessions of their own and would outlive us).
    stop = install_stop()
    try:
        redis_url, bus = connect_bus(opts.redis_url, tmp, servers)
        s3_env = s3_secrets.worker_env(_manifest_files(opts.files), state_dir)
        backend = LocalBackend(state_dir, redis_url, extra_env=s3_env)
        configs = [pool_config(wp, opts.workers) for wp in pools]
        for wp, cfg in zip(pools, configs, strict=True):
            backend.pool_args[cfg.key] = worker_serving_args(wp.spec.serving)
        settings = CoreSettings(
            cold_capacity=opts.workers, channel_url=redis_url, work_dir=state_dir, lend_gpus_only=False
        )
        core = ControlCore(
            backend, bus, settings, configs, on_status=status.job, on_adapter_status=status.adapter
        )
        for job, base in jobs:
            rec = job_record(
                job, created=time.time(), dataset=resolve_dataset(job.spec.dataset, base),
                artifact=artifact_dir(job, state_dir).resolve(),
            )  # fmt: skip
            rec.generation = rec.generation or 1
            core.submit(rec)
        for adapter, base in adapters:
            meta = adapter.metadata
            core.serving.upsert_adapter(
                AdapterRecord(
                    meta.namespace or "default", meta.name or "", adapter.spec, meta.generation or 1, base
                )
            )
        core.tick()  # pool records in the registry before the gateway reads it: the models are listed at once
        keys = LocalKeys(
            lambda: _manifest_files(opts.files), bus.redis, bus.ns,
            lambda: namespace_models(pools, core.serving.adapters.values()),
        )  # fmt: skip
        try:
            auth = "required" if keys.publish() else "off"
        except (KeyFileError, OSError, yaml.YAMLError) as exc:
            raise RunError(f"cannot read the API key Secrets: {exc}") from exc
        if auth == "off":
            print(
                'no API key Secret (label elastune.dev/api-key: "true") in the -f files: authentication '
                "is off, so the gateway listens on loopback (127.0.0.1) only",
                file=err,
                flush=True,
            )
        else:
            print("API keys from the -f files: requests need Authorization: Bearer <key>", file=err,
                  flush=True)  # fmt: skip
        port = opts.port or free_port()
        # The gateway's /metrics names every key and model: on a port of its own, as in the chart.
        metrics_port = free_port()
        (state_dir / GATEWAY_METRICS_FILE).write_text(f"http://127.0.0.1:{metrics_port}/metrics\n")

        def start_gateway() -> subprocess.Popen[bytes]:
            log = (state_dir / "logs" / "gateway.log").open("ab")
            argv = [sys.executable, "-m", "elastune_gateway.server", "--redis-url", redis_url]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--auth", auth]
            argv += ["--metrics-port", str(metrics_port)]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", KEY_FILE_ENV: str(backend.request_key_file)}
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

        gateway = start_gateway()
        # Ready = the gateway has read the registry once, so /v1/models answers with the pools' models.
        _wait_http(f"http://127.0.0.1:{port}/readyz", gateway)
        watched = {"gateway": Backoff("gateway"), "redis": Backoff("redis")}
        models = [p.spec.model for p in pools] + [a.metadata.name or "" for a, _ in adapters]
        published = [j.spec.output.publish for j, _ in jobs if j.spec.output and j.spec.output.publish]
        print(f"OpenAI base URL: http://127.0.0.1:{port}/v1", file=out, flush=True)
        print(
            f"models: {', '.join(models + [f'{p} (once its TuningJob succeeds)' for p in published])}",
            file=out,
            flush=True,
        )
        print(f"state, logs and status in {state_dir}; Ctrl-C stops", file=err, flush=True)
        print(
            f"workers' control token (Bearer, for /v1/load_lora_adapter and /v1/unload_lora_adapter on a "
            f"worker): {backend.control_token_file}",
            file=err,
            flush=True,
        )
        deadline = time.monotonic() + opts.timeout if opts.timeout else None
        next_keys = time.monotonic() + KEYS_REREAD_S
        rounds = Rounds(core, err)
        while not stop.requested and (deadline is None or time.monotonic() < deadline):
            rounds.tick()
            if auth == "required" and time.monotonic() >= next_keys:
                next_keys = time.monotonic() + KEYS_REREAD_S
                try:
                    keys.publish()  # a key Secret removed from the files stops working within seconds
                except Exception as exc:  # Redis away a moment: the next round writes it again
                    print(f"cannot publish the API keys: {exc}", file=err, flush=True)
            now = time.monotonic()
            embedded = next((s for s in servers if s.name == "redis-server"), None)
            if embedded is not None and embedded.proc.poll() is not None:
                b = watched["redis"]
                if b.due is None:
                    print(f"the embedded Redis exited ({embedded.proc.returncode}): restarting it", file=err,
                          flush=True)  # fmt: skip
                if b.exited(now) and b.ready(now):
                    try:
                        servers[servers.index(embedded)] = restart_redis(embedded, tmp)
                        b.restarted(now)
                        print("the embedded Redis is back (the control plane re-asserts its records)",
                              file=err, flush=True)  # fmt: skip
                    except ServerError as exc:
                        b.failed(now)
                        print(f"cannot restart the embedded Redis yet: {exc}", file=err, flush=True)
            if gateway.poll() is not None:
                b = watched["gateway"]
                if b.due is None:
                    print(f"the gateway exited with code {gateway.returncode} (see {state_dir}/logs/"
                          "gateway.log): restarting it", file=err, flush=True)  # fmt: skip
                if b.exited(now) and b.ready(now):
                    gateway = start_gateway()
                    b.restarted(now)
            time.sleep(settings.round_seconds)
        return 0
    except (ServerError, BusUnreachable) as exc:
        raise RunError(str(exc)) from exc
    finally:
        if gateway is not None:
            gateway.terminate()
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                gateway.kill()
        if backend is not None:
            backend.close()
        for server in servers:
            server.stop()
        forget_embedded_password(servers)
        shutil.rmtree(tmp, ignore_errors=True)
