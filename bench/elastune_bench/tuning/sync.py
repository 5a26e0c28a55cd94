"""Per-step compute vs gradient-sync time of data-parallel prompt tuning over the storage channels.

    python -m elastune_bench.tuning.sync [--quick] [--json PATH] [--steps N] [--warmup W] [--repeats R]
        [--batch-size B] [--backends redis,memcached] [--workers 1,2,4] [--model-dir DIR]

For every backend (a real ``redis-server`` or ``memcached -I 8m`` started here) and worker count N, N
worker processes tune the tiny model's soft prompt (promptTuning) with the SAME global batch, so each
worker's shard shrinks as N grows, and average their gradients with ``StorageAllReduce``. The trainer
times every step's compute (forward, backward, optimizer) and sync (the whole all-reduce, including the
wait for the slowest peer) separately; warm-up steps are dropped and medians are taken over steps and
workers. Steps/s is the job's: worker 0's finished steps over wall time after the warm-up.

Workers are long-lived processes, one per rank, reused from configuration to configuration the way a warm
pool's workers take job after job: each configuration builds a fresh Trainer (model load, PEFT init) in
every process, but torch and transformers are imported once per process, not once per configuration,
which is what keeps ``--quick`` short on two cores.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = ["BenchConfig", "BenchError", "main", "run"]

BACKENDS = ("redis", "memcached")
MEMCACHED_ITEM_BYTES = 8 * 1024 * 1024  # `-I 8m`: one item per gradient chunk, no client-side splitting
TASK = ("classify", 0)
PAPER_SYNC_SHARE = "0.4-0.5 %"
ONE_WORKER_SYNC = (
    "world=1 runs through StorageAllReduce like a 1-GPU job of the tuning CLI, which returns a copy of the "
    "gradients without touching the store (there is no peer), so sync is ~0; one run serves both backends"
)


class BenchError(RuntimeError):
    """A bench worker failed or a server did not start."""


@dataclass(frozen=True)
class BenchConfig:
    steps: int = 100
    warmup: int = 10
    repeats: int = 3
    batch_size: int = 16
    backends: tuple[str, ...] = BACKENDS
    workers: tuple[int, ...] = (1, 2, 4)
    virtual_tokens: int = 20
    n_train: int = 256
    timeout_s: float = 120.0  # generous: the first step also waits for the slowest peer's model load
    quick: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.warmup < self.steps:
            raise ValueError(f"need 1 <= warmup < steps, got warmup={self.warmup} steps={self.steps}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"worker counts must be >= 1, got {self.workers}")
        if self.batch_size < max(self.workers):
            raise ValueError(f"batch size {self.batch_size} leaves some of {max(self.workers)} workers idle")
        unknown = set(self.backends) - set(BACKENDS)
        if not self.backends or unknown:
            raise ValueError(f"backends must be among {BACKENDS}, got {self.backends}")


# ------------------------------------------------------------------------------------ worker side
def _serve() -> int:
    """Bench worker: answers one JSON command per stdin line with one JSON line (see ``_train``)."""
    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # whatever a library prints goes to the log, never into the protocol
    sys.stdout = sys.stderr

    import torch

    torch.set_num_threads(1)  # one core per worker, like one GPU per pod

    def send(msg: dict[str, Any]) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    import elastune_worker.tuning.trainer  # noqa: F401  (the import cost is paid before "ready")

    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        try:
            send(_train(json.loads(line)))
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        gc.collect()  # free this configuration's model before the next one is timed
    return 0


def _train(cmd: dict[str, Any]) -> dict[str, Any]:
    from elastune_worker.comm import StorageAllReduce, make_channel
    from elastune_worker.tuning.data import load_dataset
    from elastune_worker.tuning.trainer import Trainer, TuningConfig

    channel = make_channel(cmd["channel"])
    try:
        allreduce = StorageAllReduce(
            channel, cmd["job"], cmd["worker"], cmd["world"], timeout_s=cmd["timeout_s"]
        )
        trainer = Trainer(
            cmd["model_dir"],
            TuningConfig(**cmd["config"]),
            load_dataset(cmd["train"]),
            [],  # no eval split: nothing but training steps is timed
            worker=cmd["worker"],
            world=cmd["world"],
            allreduce=allreduce,
        )
        # Wall clock for the job's rate; this process's CPU time per step shows how much of a step's wall
        # time the worker actually ran (on a shared box the rest is waiting for a core).
        ends: list[float] = []
        cpu = [time.process_time()]

        def mark(_info: object) -> None:
            ends.append(time.monotonic())
            cpu.append(time.process_time())

        trainer.run(progress_cb=mark)
    finally:
        channel.close()
    return {
        "worker": cmd["worker"],
        "n_trainable": trainer.n_trainable,
        "compute_s": [h["seconds"] for h in trainer.history],
        "sync_s": [h["sync_seconds"] for h in trainer.history],
        "ends": ends,
        "cpu_s": [b - a for a, b in itertools.pairwise(cpu)],
    }


# ------------------------------------------------------------------------------------ parent side
def _worker_env() -> dict[str, str]:
    import elastune_bench
    import elastune_worker

    # The worker processes run this module: both packages' folders go first on their path.
    roots = [str(Path(m.__file__ or "").resolve().parents[1]) for m in (elastune_bench, elastune_worker)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # One thread per worker, and no busy-waiting OpenMP threads stealing the other workers' core.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    env.update(TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*roots, env.get("PYTHONPATH", "")) if p)
    return env


class _Pool:
    """``size`` bench worker processes; rank i of every configuration runs in process i."""

    def __init__(self, size: int, logdir: Path) -> None:
        self.logs = [logdir / f"worker-{i}.log" for i in range(size)]
        self.procs: list[subprocess.Popen[str]] = []
        argv = [sys.executable, "-m", "elastune_bench.tuning.sync", "--serve-worker"]
        env = _worker_env()
        for log in self.logs:
            with log.open("w") as err:
                self.procs.append(
                    subprocess.Popen(
                        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True
                    )
                )

    def _pipes(self, i: int) -> tuple[IO[str], IO[str]]:
        proc = self.procs[i]
        assert proc.stdin is not None and proc.stdout is not None
        return proc.stdin, proc.stdout

    def _read(self, i: int) -> dict[str, Any]:
        line = self._pipes(i)[1].readline()
        if not line:
            code = self.procs[i].wait()
            tail = self.logs[i].read_text(errors="replace")[-3000:]
            raise BenchError(f"bench worker {i} exited with code {code}:\n{tail}")
        return json.loads(line)

    def wait_ready(self) -> None:
        for i in range(len(self.procs)):
            self._read(i)

    def run(self, cmds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, cmd in enumerate(cmds):  # all ranks get their command before any reply is awaited
            stdin = self._pipes(i)[0]
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()
        replies = [self._read(i) for i in range(len(cmds))]
        errors = [f"worker {i}: {r['traceback']}" for i, r in enumerate(replies) if "error" in r]
        if errors:
            raise BenchError("\n".join(errors))
        return replies

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _model_info(model_dir: Path) -> dict[str, Any]:
    cfg = json.loads((model_dir / "config.json").read_text())
    keys = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")
    return {"dir": str(model_dir), **{k: cfg.get(k) for k in keys}}


def _shards(batch: int, world: int) -> list[int]:
    base, extra = divmod(batch, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


def _cell(runs: list[list[dict[str, Any]]], bc: BenchConfig, world: int) -> dict[str, Any]:
    """Figures of one (backend, worker count) over its repeats; ``runs`` holds each run's replies."""
    compute = [c for run in runs for r in run for c in r["compute_s"][bc.warmup :]]
    sync = [s for run in runs for r in run for s in r["sync_s"][bc.warmup :]]
    step = [c + s for c, s in zip(compute, sync, strict=True)]
    cpu = [x for run in runs for r in run for x in r["cpu_s"][bc.warmup :]]
    rates = []
    for run in runs:
        ends = run[0]["ends"]  # ranks move in lockstep (each step waits for all): rank 0 is the job
        rates.append((bc.steps - bc.warmup) / (ends[-1] - ends[bc.warmup - 1]))
    ms = 1000.0
    return {
        "workers": world,
        "per_worker_batch": _shards(bc.batch_size, world),
        "samples": len(compute),
        "compute_ms": round(statistics.median(compute) * ms, 4),
        "sync_ms": round(statistics.median(sync) * ms, 4),
        "step_ms": round(statistics.median(step) * ms, 4),
        "step_cpu_ms": round(statistics.median(cpu) * ms, 4),
        "compute_ms_mean": round(statistics.fmean(compute) * ms, 4),
        "sync_ms_mean": round(statistics.fmean(sync) * ms, 4),
        "sync_ms_p90": round(statistics.quantiles(sync, n=10)[-1] * ms, 4) if len(sync) > 1 else None,
        # share of the time steps spent in sync, over all measured steps and workers (the paper's measure)
        "sync_share": round(sum(sync) / sum(step), 5),
        "steps_per_s": round(statistics.median(rates), 3),
        "steps_per_s_runs": [round(r, 3) for r in rates],
    }


def run(
    bc: BenchConfig,
    json_path: Path | None = None,
    model_dir: Path | None = None,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Run the grid, print the table and note to ``out`` (default: the current ``sys.stdout``), write
    ``json_path`` and return the report."""
    from elastune_common.servers import Server, ServerError, start_memcached, start_redis
    from elastune_demo import build, tasks

    t0 = time.monotonic()
    load_start = os.getloadavg()
    p = lambda s: print(s, file=out or sys.stdout, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="elastune-bench-sync-") as tmp:
        tmpd = Path(tmp)
        pool = _Pool(max(bc.workers), tmpd)  # imports run while the model and servers come up
        servers: dict[str, Server] = {}
        try:
            mdir = Path(model_dir) if model_dir is not None else build.ensure_tiny_model()
            model = _model_info(mdir)
            task = tasks.make_task(tasks.TaskSpec(*TASK), n_train=bc.n_train, n_eval=0, seed=0)
            train = tasks.write_jsonl(task.train, tmpd / "train.jsonl")
            config = {
                "method": "promptTuning",
                "virtual_tokens": bc.virtual_tokens,
                "batch_size": bc.batch_size,
                "max_iterations": bc.steps,
                "max_length": min(128, (model["n_positions"] or 1024) - bc.virtual_tokens),
                "seed": 0,
            }
            try:
                for b in bc.backends:
                    if b == "redis":
                        servers[b] = start_redis(tmpd / b)
                    else:
                        servers[b] = start_memcached(tmpd / b, "-I", "8m", "-m", "256")
            except ServerError as exc:
                raise BenchError(str(exc)) from exc
            urls = {b: s.url for b, s in servers.items()}
            if "memcached" in urls:  # let the client send whole chunks the server's `-I 8m` accepts
                urls["memcached"] += f"?max_item_size={MEMCACHED_ITEM_BYTES}"
            pool.wait_ready()
            p(
                f"elastune bench sync: {model['n_layer']}-layer {model['n_embd']}-wide tiny GPT-2, "
                f"{bc.virtual_tokens} virtual tokens, global batch {bc.batch_size}, {bc.steps} steps "
                f"({bc.warmup} warm-up) x {bc.repeats} run(s) per configuration"
            )

            def one(backend: str, world: int) -> list[dict[str, Any]]:
                job = f"bench-sync-{backend}-w{world}-{uuid.uuid4().hex[:8]}"
                common = {"model_dir": str(mdir), "train": str(train), "config": config, "world": world}
                common |= {"channel": urls[backend], "job": job, "timeout_s": bc.timeout_s}
                cmds = [{**common, "worker": w} for w in range(world)]
                replies = pool.run(cmds)
                c = statistics.median(x for r in replies for x in r["compute_s"][bc.warmup :]) * 1000
                s = statistics.median(x for r in replies for x in r["sync_s"][bc.warmup :]) * 1000
                p(f"  {backend:<9} {world} worker(s): compute {c:7.2f} ms  sync {s:7.3f} ms")
                return replies

            runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
            for _ in range(bc.repeats):  # repeats interleaved: drifting co-load hits every cell alike
                if 1 in bc.workers:
                    runs.setdefault(("*", 1), []).append(one(bc.backends[0], 1))
                for b in bc.backends:
                    for n in bc.workers:
                        if n > 1:
                            runs.setdefault((b, n), []).append(one(b, n))
        finally:
            pool.close()
            for server in servers.values():
                server.stop()

    n_trainable = next(iter(runs.values()))[0][0]["n_trainable"]
    results: dict[str, Any] = {}
    for b in bc.backends:
        cells: dict[str, Any] = {}
        for n in bc.workers:
            cell = _cell(runs[("*", 1) if n == 1 else (b, n)], bc, n)
            cell["sync_mode"] = ONE_WORKER_SYNC if n == 1 else f"StorageAllReduce scatter-reduce over {b}"
            cells[f"workers_{n}"] = cell
        if 1 in bc.workers:
            base = cells["workers_1"]["steps_per_s"]
            for cell in cells.values():
                cell["speedup_vs_1"] = round(cell["steps_per_s"] / base, 3)
        results[b] = cells

    cores = os.cpu_count() or 1
    load_end = os.getloadavg()
    report: dict[str, Any] = {
        "config": {
            **asdict(bc),
            "tuning": config,
            "task": f"{TASK[0]}-{TASK[1]:02d}",
            "threads_per_worker": 1,
        },
        "model": model,
        "gradient": {"floats": n_trainable + 1, "bytes": 4 * (n_trainable + 1)},  # +1: the loss slot
        "machine": {
            "cores": cores,
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in load_end],
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        **results,
        "notes": {
            "workers_1": ONE_WORKER_SYNC,
            "summary": _note(bc, cores, n_trainable + 1, (load_start[0], load_end[0])),
        },
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    p("")
    p(format_table(report, bc))
    p("")
    p(report["notes"]["summary"])
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        p(f"\nwrote {json_path}")
    return report


def format_table(report: dict[str, Any], bc: BenchConfig) -> str:
    head = (
        f"{'backend':<10}{'workers':>8}{'batch/worker':>14}{'compute ms':>12}{'sync ms':>10}"
        f"{'sync share':>12}{'cpu ms':>8}{'steps/s':>9}{'speedup':>9}"
    )
    lines = [head, "-" * len(head)]
    for b in bc.backends:
        for n in bc.workers:
            c = report[b][f"workers_{n}"]
            batch = "/".join(str(x) for x in sorted(set(c["per_worker_batch"]), reverse=True))
            speedup = f"{c['speedup_vs_1']:.2f}" if "speedup_vs_1" in c else "-"
            lines.append(
                f"{b:<10}{n:>8}{batch:>14}{c['compute_ms']:>12.2f}{c['sync_ms']:>10.3f}"
                f"{100 * c['sync_share']:>11.1f}%{c['step_cpu_ms']:>8.1f}{c['steps_per_s']:>9.2f}{speedup:>9}"
            )
    lines.append(
        "medians over post-warm-up steps and workers; sync share = total sync / total step time; cpu ms = "
        "CPU time a worker used per step (below compute + sync: it waited for a core); 1 worker: no "
        "storage round trip (see note)"
    )
    return "\n".join(lines)


def _note(bc: BenchConfig, cores: int, floats: int, load: tuple[float, float]) -> str:
    top = max(bc.workers)
    over = (
        f"{top} workers oversubscribe it {top / cores:g}:1, so no speedup beyond about {cores} is possible "
        "and part of their 'sync' is waiting for peers the OS has descheduled"
        if top > cores
        else f"up to {top} workers each get a core, but other jobs share them"
    )
    return (
        f"Honest note: this machine has {cores} CPU cores and no GPU, shared with other jobs (1-minute load "
        f"average {load[0]:.1f} at the start, {load[1]:.1f} at the end); every worker is a process with one "
        f"torch thread, and {over}. Where 'cpu ms' is well below compute + sync, workers spent the "
        "difference waiting for a core, so per-worker compute shrinks less than the per-worker batch does. "
        "'Sync' is the whole all-reduce as the trainer times it: uploads, polling the store every 2 ms and "
        "waiting for the slowest peer's compute, so it bounds the communication cost from above. The "
        f"gradient is tiny ({floats:,} float32 values, {4 * floats / 1024:.1f} KiB), so sync is latency-"
        "bound, not bandwidth-bound. With 1 worker the all-reduce has no peer and returns a copy without "
        "touching the store (sync ~0, one run for both backends). PromptTuner reports communication at "
        f"{PAPER_SYNC_SHARE} of execution time with near-linear scaling on A100 GPUs, where a step's compute "
        "dwarfs a store's millisecond round trips; here a step computes for tens of milliseconds on a CPU, "
        "so the sync share is far higher and these figures do not test that claim: they show the mechanism "
        "works end to end and what it costs on a small, shared CPU box."
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="elastune bench sync", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="12 steps (3 warm-up), 1 run per configuration")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    p.add_argument("--steps", type=int, help="steps per run, warm-up included (default 100, --quick 12)")
    p.add_argument("--warmup", type=int, help="steps dropped at the start of each run (default 10, quick 3)")
    p.add_argument("--repeats", type=int, help="runs per configuration (default 3, --quick 1)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, the same for every world size")
    p.add_argument("--backends", type=_name_list, default=BACKENDS, help="comma-separated (redis,memcached)")
    p.add_argument("--workers", type=_int_list, default=(1, 2, 4), help="comma-separated worker counts")
    p.add_argument("--model-dir", type=Path, help="a built tiny model (default: the cached default one)")
    p.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_worker:
        return _serve()

    quick = args.quick
    try:
        bc = BenchConfig(
            steps=args.steps or (12 if quick else 100),
            warmup=args.warmup if args.warmup is not None else (3 if quick else 10),
            repeats=args.repeats or (1 if quick else 3),
            batch_size=args.batch_size,
            backends=args.backends,
            workers=args.workers,
            quick=quick,
        )
    except ValueError as exc:
        p.error(str(exc))
    try:
        run(bc, args.json, args.model_dir)
    except BenchError as exc:
        print(f"bench sync failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
