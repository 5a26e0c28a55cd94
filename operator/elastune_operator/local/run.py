"""`elastune run -f tuningjob.yaml`: the whole loop on one machine, no cluster, no GPU.

Starts an embedded redis-server (control bus and, by default, the gradient storage channel), a local
warm pool of CPU worker processes (the Local backend) and the same control core and PromptTuner
scheduler the operator runs; drives the TuningJobs to completion with a progress display, then prints
and saves the optimized prompt and the status the operator would write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from elastune_common.bus import Bus, BusUnreachable
from elastune_common.servers import Server, ServerError, start_memcached, start_redis
from elastune_contract.api import manifests, units
from elastune_contract.api.tuningjob import TuningJob
from elastune_contract.api.warmpool import WarmPool
from elastune_contract.protocol import PASSWORD_ENV
from elastune_contract.vocabulary import ConditionType, Reason
from elastune_operator.control.core import ControlCore
from elastune_operator.control.lifecycle import status_dict
from elastune_operator.control.records import CoreSettings, JobRecord, PoolConfig
from elastune_operator.control.resources import (
    DEFAULT_COLD_START_SECONDS,
    artifact_dir,
    job_record,
    pool_config,
)
from elastune_operator.local import s3_secrets
from elastune_operator.local.backend import LocalBackend
from elastune_operator.local.rounds import Rounds
from elastune_operator.scheduling.policy import PolicyName

log = logging.getLogger("elastune.run")


class RunError(Exception):
    """Bad input or environment: printed as is, exit code 2."""


@dataclass
class RunOptions:
    files: list[Path]
    workers: int = 2
    state_dir: Path = Path(".elastune")
    redis_url: str | None = None
    channel: str = "redis"
    """redis (the embedded Redis), memcached (an embedded memcached) or a redis:// / memcached:// URL."""
    timeout: float | None = None
    eval_every: int = 10
    checkpoint_every: int = 10
    collective_timeout_s: float = 60.0
    policy: PolicyName = "promptTuner"
    """The scheduling policy (promptTuner, or a baseline of the paper: infless, elasticflow)."""


def resolve_dataset(uri: str, base: Path) -> str:
    if "://" in uri or uri.startswith("/"):
        return uri
    return str((base / uri).resolve())


def plan(opts: RunOptions) -> tuple[list[PoolConfig], list[tuple[TuningJob, Path]]]:
    """Pools and jobs from the manifests; every problem raises RunError naming file and field."""
    try:
        found = manifests.load(opts.files)
    except (OSError, yaml.YAMLError) as exc:
        raise RunError(f"cannot read manifests: {exc}") from exc
    bad = [m for m in found if m.problems]
    if bad:
        lines = [f"{m.file}: {m.name}: invalid" + "".join(f"\n  {p}" for p in m.problems) for m in bad]
        raise RunError("\n".join(lines))
    jobs = [(m.resource, m.file.resolve().parent) for m in found if isinstance(m.resource, TuningJob)]
    if not jobs:
        raise RunError(f"no TuningJob in {', '.join(map(str, opts.files))}")
    # By pool id: two namespaces may each have a WarmPool of one model (the core resolves a job's).
    pools = {
        (cfg := pool_config(m.resource, opts.workers)).key: cfg
        for m in found
        if isinstance(m.resource, WarmPool)
    }
    for job, _ in jobs:
        model = job.spec.model
        if all(p.model != model for p in pools.values()):  # local default: this machine's workers
            name = "local-" + re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")
            pools[f"default/{name}"] = PoolConfig(
                name=name, model=model, max_warm=opts.workers, cold_start_seconds=DEFAULT_COLD_START_SECONDS
            )
    return list(pools.values()), jobs


class Progress:
    """One line per job: a bar on a terminal, a line per change otherwise (CI logs)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self._last: dict[str, str] = {}
        self._drawn = 0

    def line(self, job: JobRecord, now: float) -> str:
        st = job.status
        total = job.spec.termination.max_iterations
        done = st.iterations or 0
        width = 24
        filled = int(width * min(done, total) / total)
        bar = "#" * filled + "-" * (width - filled)
        metric = job.spec.termination.target.metric if job.spec.termination.target else "loss"
        state = _phase(job)
        value = st.current_metric or "-"
        gpus = st.allocated_gpus or 0
        elapsed = units.format_duration(int(now - job.created)) if now > job.created else "0s"
        return (
            f"{job.key:<24} [{bar}] {done:>4}/{total} it  {metric} {value:<8} {gpus} GPU  "
            f"{state:<10} {elapsed} / {job.spec.deadline}"
        )

    def update(self, jobs: list[JobRecord], now: float, final: bool = False) -> None:
        lines = [self.line(j, now) for j in jobs]
        if self.tty:
            if self._drawn:
                self.out.write(f"\x1b[{self._drawn}F")
            for line in lines:
                self.out.write("\x1b[2K" + line + "\n")
            self._drawn = len(lines)
            self.out.flush()
            return
        for job, line in zip(jobs, lines, strict=True):
            key = re.sub(r"\s+\S+ / \S+$", "", line)  # ignore the clock
            if key != self._last.get(job.key) and (
                final or _phase(job) != "Running" or _step_changed(self._last.get(job.key), line)
            ):
                self.out.write(line + "\n")
                self.out.flush()
                self._last[job.key] = key


def _step_changed(prev: str | None, line: str) -> bool:
    """Outside a terminal, print running jobs every 10 iterations."""
    if prev is None:
        return True
    it = lambda s: int(re.search(r"(\d+)/\d+ it", s).group(1))  # type: ignore[union-attr]  # noqa: E731
    return it(line) // 10 != it(prev) // 10


def _phase(job: JobRecord) -> str:
    conds = {c.type: c for c in job.status.conditions}
    done, running, scheduled = ConditionType.SUCCEEDED, ConditionType.RUNNING, ConditionType.SCHEDULED
    if done in conds and conds[done].status != "Unknown":
        return "Succeeded" if conds[done].status == "True" else "Failed"
    if running in conds and conds[running].status == "True":
        return "Running"
    if scheduled in conds and conds[scheduled].reason == Reason.POOL_GROWING:
        return "Warming"
    if scheduled in conds and conds[scheduled].status == "True":
        return "Scheduled"
    return Reason.PENDING  # what Scheduled=False says while the job waits


def resource_with_status(job: TuningJob, record: JobRecord) -> dict[str, Any]:
    obj = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    obj["status"] = status_dict(record)
    return obj


def connect_bus(redis_url: str | None, tmp: Path, servers: list[Server]) -> tuple[str, Bus]:
    """The given Redis, or an embedded one started under ``tmp`` (appended to ``servers`` to stop).

    The embedded one requires a password generated here (any local user could otherwise flush it or
    write the API key map): it reaches this process's clients and every child (workers, the gateway)
    through ``ELASTUNE_REDIS_PASSWORD``, never a URL or a command line."""
    if redis_url is None:
        password = secrets.token_urlsafe(24)
        os.environ[PASSWORD_ENV] = password  # removed again by forget_embedded_password()
        servers.append(start_redis(tmp / "redis", password=password))
        redis_url = servers[-1].url
    bus = Bus(redis_url)
    bus.ping()
    return redis_url, bus


def forget_embedded_password(servers: list[Server]) -> None:
    """Undo connect_bus's environment once its embedded Redis is gone (a caller in the same process, a
    test, must not send that password to another Redis)."""
    if any(s.name == "redis-server" for s in servers):
        os.environ.pop(PASSWORD_ENV, None)


def restart_redis(server: Server, tmp: Path) -> Server:
    """The embedded Redis again, on the same port with the same password (the control plane re-asserts
    what it owns there; workers re-register with their next heartbeat)."""
    return start_redis(tmp / "redis", port=server.port, password=os.environ.get(PASSWORD_ENV))


def manifest_uid(job: TuningJob) -> str:
    """The id of a local TuningJob: the same for the same namespace, name and spec, so `elastune run`
    interrupted and run again with the same manifest and state directory finds its checkpoints (under
    ``<state>/checkpoints/<namespace>/<name>/<id>``) and resumes from the newest; a changed spec is a new
    job and starts from iteration 0."""
    meta = job.metadata
    ident = {"key": f"{meta.namespace or 'default'}/{meta.name}", "spec": job.spec.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def run(opts: RunOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    pools, jobs = plan(opts)
    state_dir = opts.state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, tuple[TuningJob, JobRecord]] = {}
    now = time.time()
    for job, base in jobs:
        try:
            artifact = artifact_dir(job, state_dir).resolve()
        except ValueError as exc:
            raise RunError(f"{job.metadata.name}: {exc}") from exc
        rec = job_record(job, created=now, dataset=resolve_dataset(job.spec.dataset, base), artifact=artifact)
        rec.generation = rec.generation or 1
        rec.uid = manifest_uid(job)
        if rec.key in records:
            raise RunError(f"TuningJob {rec.key} appears twice")
        records[rec.key] = (job, rec)

    servers: list[Server] = []
    backend: LocalBackend | None = None
    tmp = Path(tempfile.mkdtemp(prefix="servers-", dir=state_dir))
    stop = install_stop()  # before anything starts: a SIGTERM during start-up still cleans up
    try:
        redis_url, bus = connect_bus(opts.redis_url, tmp, servers)
        channel_url = opts.channel
        if channel_url == "redis":
            channel_url = redis_url
        elif channel_url == "memcached":
            servers.append(start_memcached(tmp / "memcached", "-I", "8m", "-m", "256"))
            channel_url = servers[-1].url
        backend = LocalBackend(state_dir, redis_url, extra_env=s3_secrets.worker_env(opts.files, state_dir))
        settings = CoreSettings(
            cold_capacity=opts.workers,
            channel_url=channel_url,
            work_dir=state_dir,
            collective_timeout_s=opts.collective_timeout_s,
            eval_every=opts.eval_every,
            checkpoint_every=opts.checkpoint_every,
            policy=opts.policy,
            lend_gpus_only=False,
        )
        core = ControlCore(backend, bus, settings, pools)
        progress = Progress(err)
        print(
            f"elastune run: {len(records)} TuningJob(s), {opts.workers} local CPU worker(s) max, "
            f"state in {state_dir}",
            file=err,
        )
        for _, rec in records.values():
            _say_resume(rec, state_dir, err)
            core.submit(rec)
        deadline = time.monotonic() + opts.timeout if opts.timeout else None
        last_draw = 0.0
        rounds = Rounds(core, err)
        while not core.done():
            rounds.tick()
            if stop.requested:
                raise RunError(
                    "interrupted: jobs left unfinished; their checkpoints are kept in "
                    f"{state_dir / 'checkpoints'}: run the same command again to resume them"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise RunError(f"--timeout of {opts.timeout:g} s reached with jobs unfinished")
            t = time.monotonic()
            if t - last_draw >= 0.5:
                progress.update([r for _, r in records.values()], time.time())
                last_draw = t
            time.sleep(settings.round_seconds)
        progress.update([r for _, r in records.values()], time.time(), final=True)
        return _report(records, state_dir, out)
    except (ServerError, BusUnreachable) as exc:
        raise RunError(str(exc)) from exc
    finally:
        if backend is not None:
            backend.close()
        for server in servers:
            server.stop()
        forget_embedded_password(servers)
        shutil.rmtree(tmp, ignore_errors=True)


def _say_resume(rec: JobRecord, state_dir: Path, err: TextIO) -> None:
    """Whether the job resumes from a checkpoint of an earlier run of the same manifest, and from where."""
    ckpt = state_dir / "checkpoints" / rec.key / rec.uid
    newest = max(ckpt.glob("ckpt-*.pt"), default=None)  # the trainer's names sort by iteration
    if newest is not None:
        print(f"{rec.key}: resuming from its checkpoint {newest.name} in {ckpt}", file=err)
    elif (state_dir / "checkpoints" / rec.key).is_dir():
        print(
            f"{rec.key}: checkpoints of an earlier run are in {state_dir / 'checkpoints' / rec.key}, but "
            "none of this spec (it changed): starting from iteration 0",
            file=err,
        )


def _report(records: dict[str, tuple[TuningJob, JobRecord]], state_dir: Path, out: TextIO) -> int:
    failed = 0
    for job, rec in records.values():
        obj = resource_with_status(job, rec)
        path = state_dir / "status" / f"{rec.key}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        st = rec.status
        succeeded = next(c for c in st.conditions if c.type == ConditionType.SUCCEEDED)
        print(f"\nTuningJob {rec.key}: {_phase(rec)} ({succeeded.reason})", file=out)
        if succeeded.status != "True":
            failed += 1
            print(f"  reason:   {succeeded.message}", file=out)
        metric = rec.spec.termination.target.metric if rec.spec.termination.target else "loss"
        if st.initial_metric is not None or st.current_metric is not None:
            print(
                f"  {metric}: {st.initial_metric or '-'} with the initial prompt -> "
                f"{st.current_metric or '-'} tuned",
                file=out,
            )
        if st.iterations is not None:
            print(
                f"  iterations: {st.iterations}   attempts: {st.attempts or 0}   "
                f"GPU-seconds: {st.gpu_seconds}",
                file=out,
            )
        if st.slo_met is not None:
            print(f"  deadline {rec.spec.deadline}: {'met' if st.slo_met else 'missed'}", file=out)
        if st.optimized_prompt is not None:
            print(f"  optimized prompt (nearest tokens): {st.optimized_prompt!r}", file=out)
        if st.artifact_uri:
            print(f"  artifact: {st.artifact_uri}", file=out)
        print(f"  status:   {path}", file=out)
    return 1 if failed else 0


class _Stop:
    requested = False


def install_stop() -> _Stop:
    stop = _Stop()

    def handler(_signum: int, _frame: object) -> None:
        stop.requested = True

    try:
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (tests): no handler
        pass
    return stop
