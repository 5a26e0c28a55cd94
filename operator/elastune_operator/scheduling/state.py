"""Bookkeeping of GPU pools and jobs that every policy reads and every environment mutates.

One shared cold pool with a fixed capacity (GPUs with nothing loaded; cost nothing) and one warm pool
per LLM (GPUs with the runtime and weights loaded, or loading; paid whether busy or idle). The key
``llm`` names a warm pool: the paper's LLM in the simulator, the pool id (namespace/name of a
WarmPool, which serves one LLM) in the control plane, where two namespaces may each have a pool of one
model; the algorithms run per key either way. The
environment — the simulator, the local backend or the Knative backend — owns a ``ClusterState``,
applies a policy's ``RoundDecision`` through its methods, and reports physics back (a GPU became
warm, a job finished). ``version`` increases on every mutation so policies can skip rounds in which
nothing they read has changed.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from enum import StrEnum

from .latency_budget import BankMode


class GPUState(StrEnum):
    STARTING = "starting"  # taken from the cold pool, loading runtime + weights (T_cold)
    IDLE = "idle"  # warm, unassigned
    HELD = "held"  # assigned to a job that has not started yet (waits for the rest of its GPUs)
    BUSY = "busy"  # running its job


@dataclass(slots=True)
class GPU:
    id: int
    llm: str
    state: GPUState
    launched_at: float
    """When it left the cold pool. Policies estimate readiness as launched_at + T_cold; only the
    environment knows when a GPU really becomes warm (it calls ``gpu_ready``)."""
    job: str | None = None
    idle_since: float = 0.0


@dataclass(slots=True)
class Job:
    """The scheduler's view of a TuningJob."""

    id: str
    llm: str
    arrival: float
    slo: float
    """Relative latency SLO in seconds (TuningJob spec.deadline)."""
    max_iterations: int
    """Termination upper bound: the estimator's 'maximum remaining iterations'."""
    done_iterations: float = 0.0
    planned_iterations: float = 0.0
    """The iteration bound the scheduler sizes the job on: ``max_iterations`` (the default, set when
    0), or fewer when the job starts from the Prompt Bank and the policy counts on the bank's minimum
    speedup (PromptTunerConfig.bank_sizing_speedup)."""
    bank_mode: BankMode = "auto"
    """TuningJob spec.promptBank: auto (latency budget decides) | always | never."""
    use_bank: bool = False
    bank_seconds: float = 0.0
    """Predicted Prompt Bank lookup time the job will spend before tuning (0 when skipped)."""
    bank_budget_seconds: float = 0.0
    """The Prompt Bank's latency budget, set once by the policy at admission (``Policy.admit``): the
    skip message in the job's status and the workers' re-check (Assignment.bank_budget_s) carry it."""
    bank_done: bool = False
    target_gpus: int = 0
    """GPUs the job was given (0 while pending). A job starts when it holds this many warm GPUs."""
    gpus: list[int] = field(default_factory=list)
    started_at: float | None = None
    predicted_finish: float | None = None
    finished_at: float | None = None
    dropped: bool = False
    """Rejected by admission control (ElasticFlow) — never runs, counts as an SLO miss."""
    coservable: bool = False
    """The job can ride along inference on a serving pod (FlexLLM co-serving): its method and model
    allow it (``elastune_contract.coserve.coservable``). Policies offer it serving pods only then."""
    deadline: float = field(init=False)
    """arrival + SLO, stored: it is the sort key of every scheduling round."""

    def __post_init__(self) -> None:
        if self.slo <= 0 or self.max_iterations < 1:
            raise ValueError(f"job {self.id!r}: slo must be > 0 and max_iterations >= 1")
        self.deadline = self.arrival + self.slo
        if self.planned_iterations <= 0:
            self.planned_iterations = float(self.max_iterations)

    @property
    def remaining_iterations(self) -> float:
        return max(0.0, self.planned_iterations - self.done_iterations)

    @property
    def pending(self) -> bool:
        return self.target_gpus == 0 and self.finished_at is None and not self.dropped


@dataclass(slots=True)
class Launch:
    """Take ``count`` GPUs from the cold pool into ``llm``'s warm pool, optionally held for a job."""

    llm: str
    count: int
    job: str | None = None


@dataclass(slots=True)
class Allocation:
    """Hand idle warm GPUs to a job that will run on ``target`` GPUs in total."""

    job: str
    gpus: list[int]
    target: int
    """Equal to len(gpus) for a gang; larger when the job must wait for more (ablation, INFless)."""


@dataclass(slots=True)
class RoundDecision:
    allocations: list[Allocation] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    releases: list[int] = field(default_factory=list)
    """Idle GPU ids returned to the cold pool."""
    restarts: list[tuple[str, int]] = field(default_factory=list)
    """(running job id, new GPU count): stop, checkpoint and re-launch elsewhere (ElasticFlow)."""

    def empty(self) -> bool:
        return not (self.allocations or self.launches or self.releases or self.restarts)


class ClusterState:
    def __init__(self, cold_capacity: int, llms: list[str]) -> None:
        if cold_capacity < 0:
            raise ValueError("cold_capacity must be >= 0")
        self.capacity = cold_capacity
        self.gpus: dict[int, GPU] = {}
        self.jobs: dict[str, Job] = {}
        self.idle: dict[str, dict[int, None]] = {llm: {} for llm in llms}  # insertion-ordered sets
        self.pool_size: dict[str, int] = dict.fromkeys(llms, 0)
        self.running: dict[str, dict[str, None]] = {llm: {} for llm in llms}
        self.waiting: dict[str, dict[str, None]] = {llm: {} for llm in llms}  # hold GPUs, not started
        self.pending: dict[str, dict[str, None]] = {llm: {} for llm in llms}
        self.starting: dict[str, dict[int, None]] = {llm: {} for llm in llms}
        """GPUs still loading that no job holds: they join the idle set when warm."""
        self.pending_version: dict[str, int] = dict.fromkeys(llms, 0)
        """Bumped whenever an LLM's pending set (or a pending job's progress) changes."""
        self.arrivals: dict[str, list[tuple[float, str]]] = {llm: [] for llm in llms}
        """(arrival, job id) of every job submitted, per LLM, sorted: recent arrival rates."""
        self.coserve_rate: dict[int, float] = {}
        """Warm GPUs whose pod serves inference right now -> the share of a dedicated GPU's tuning speed
        a job co-served there would get (FlexLLM; ``scheduling.coserving``). Such GPUs are not idle
        capacity for dedicated tuning: a policy that knows co-serving offers them only to co-servable
        jobs whose predicted co-served time meets their SLO. Reported by the environment."""
        self.version = 0
        self._next_gpu = 0

    # -- derived ------------------------------------------------------------------------------------
    @property
    def cold_free(self) -> int:
        return self.capacity - len(self.gpus)

    def warm_gpus(self) -> int:
        return len(self.gpus)

    def pending_jobs(self, llm: str) -> list[Job]:
        return [self.jobs[j] for j in self.pending[llm]]

    def counts(self, llm: str) -> dict[str, int]:
        c = dict.fromkeys(GPUState, 0)
        for g in self.gpus.values():
            if g.llm == llm:
                c[g.state] += 1
        return {k.value: v for k, v in c.items()}

    # -- mutations ----------------------------------------------------------------------------------
    def _touch(self) -> None:
        self.version += 1

    def submit(self, job: Job) -> None:
        if job.id in self.jobs:
            raise ValueError(f"duplicate job id {job.id!r}")
        if job.llm not in self.pending:
            raise KeyError(f"job {job.id!r} targets unknown LLM {job.llm!r}")
        self.jobs[job.id] = job
        self.pending[job.llm][job.id] = None
        self.pending_version[job.llm] += 1
        insort(self.arrivals[job.llm], (job.arrival, job.id))
        self._touch()

    def add_llm(self, llm: str) -> None:
        """A pool for ``llm`` joins the cluster (idempotent: an LLM already known keeps its state)."""
        for per_llm in (self.idle, self.running, self.waiting, self.pending, self.starting):
            per_llm.setdefault(llm, {})
        self.arrivals.setdefault(llm, [])
        self.pool_size.setdefault(llm, 0)
        self.pending_version.setdefault(llm, 0)

    def set_capacity(self, cold_capacity: int) -> None:
        """The cold pool's size changed (its nodes came or went: k8s.node_capacity). GPUs already taken
        from it stay where they are; below them ``cold_free`` goes negative and nothing more is
        launched until GPUs are released or nodes come back."""
        if cold_capacity < 0:
            raise ValueError("cold_capacity must be >= 0")
        if cold_capacity != self.capacity:
            self.capacity = cold_capacity
            self._touch()

    def drop(self, job_id: str) -> None:
        job = self.jobs[job_id]
        job.dropped = True
        self.pending[job.llm].pop(job_id, None)
        self.pending_version[job.llm] += 1
        self._touch()

    def remove(self, job_id: str) -> None:
        """Forget a pending job that holds no GPU (the control plane moves it to another pool before
        it ever ran: it is submitted again there)."""
        job = self.jobs.pop(job_id)
        self.pending[job.llm].pop(job_id, None)
        self.pending_version[job.llm] += 1
        arrivals = self.arrivals[job.llm]
        i = bisect_left(arrivals, (job.arrival, job_id))
        if i < len(arrivals) and arrivals[i] == (job.arrival, job_id):
            del arrivals[i]
        self._touch()

    def launch(self, llm: str, now: float, job: str | None = None, target: int = 0) -> GPU:
        """One GPU leaves the cold pool into ``llm``'s warm pool, optionally held for ``job``
        (which then runs on ``target`` GPUs once all are warm, unless it already has a target)."""
        if self.cold_free <= 0:
            raise RuntimeError("cold pool exhausted")
        gid = self._next_gpu
        self._next_gpu += 1
        gpu = GPU(gid, llm, GPUState.STARTING, launched_at=now, job=job)
        self.gpus[gid] = gpu
        self.pool_size[llm] += 1
        if job is None:
            self.starting[llm][gid] = None
        if job is not None:
            j = self.jobs[job]
            if j.target_gpus == 0:
                j.target_gpus = target
            j.gpus.append(gid)
            self._mark_waiting(j)
        self._touch()
        return gpu

    def gpu_ready(self, gid: int, now: float) -> None:
        gpu = self.gpus.get(gid)
        if gpu is None or gpu.state is not GPUState.STARTING:
            return
        self.starting[gpu.llm].pop(gid, None)
        if gpu.job is None:
            gpu.state = GPUState.IDLE
            gpu.idle_since = now
            self.idle[gpu.llm][gid] = None
        else:
            gpu.state = GPUState.HELD
        self._touch()

    def assign(self, job_id: str, gpu_ids: list[int], target_gpus: int | None = None) -> None:
        """Hand idle warm GPUs to a job. ``target_gpus`` > len(gpu_ids) means it waits for more."""
        job = self.jobs[job_id]
        for gid in gpu_ids:
            gpu = self.gpus[gid]
            if gpu.state is not GPUState.IDLE or gpu.llm != job.llm:
                raise RuntimeError(f"GPU {gid} is not an idle GPU of {job.llm}")
            gpu.state = GPUState.HELD
            gpu.job = job_id
            del self.idle[gpu.llm][gid]
            job.gpus.append(gid)
        if job.target_gpus == 0:
            job.target_gpus = target_gpus or len(gpu_ids)
        self._mark_waiting(job)
        self._touch()

    def _mark_waiting(self, job: Job) -> None:
        if job.id in self.pending[job.llm]:
            del self.pending[job.llm][job.id]
            self.pending_version[job.llm] += 1
            self.waiting[job.llm][job.id] = None
        if job.target_gpus == 0:
            job.target_gpus = len(job.gpus)

    def startable(self, job_id: str) -> bool:
        job = self.jobs[job_id]
        return (
            job.started_at is None
            and job.target_gpus > 0
            and len(job.gpus) >= job.target_gpus
            and all(self.gpus[g].state is GPUState.HELD for g in job.gpus)
        )

    def start(self, job_id: str, now: float, predicted_finish: float) -> None:
        job = self.jobs[job_id]
        for gid in job.gpus:
            self.gpus[gid].state = GPUState.BUSY
        job.started_at = now
        job.predicted_finish = predicted_finish
        self.waiting[job.llm].pop(job_id, None)
        self.running[job.llm][job_id] = None
        self._touch()

    def finish(self, job_id: str, now: float, keep_warm: bool = True) -> None:
        """The job is done; its GPUs go back to the warm pool (or straight to cold: no runtime reuse)."""
        job = self.jobs[job_id]
        job.finished_at = now
        job.done_iterations = job.max_iterations
        self.running[job.llm].pop(job_id, None)
        for gid in job.gpus:
            self._free_gpu(gid, now, keep_warm)
        self._touch()

    def preempt(self, job_id: str, done_iterations: float, now: float, keep_warm: bool) -> None:
        """Stop a running job (checkpointed at ``done_iterations``) and return it to pending."""
        job = self.jobs[job_id]
        job.done_iterations = done_iterations
        job.started_at = None
        job.predicted_finish = None
        job.target_gpus = 0
        self.running[job.llm].pop(job_id, None)
        self.waiting[job.llm].pop(job_id, None)
        for gid in job.gpus:
            self._free_gpu(gid, now, keep_warm)
        job.gpus = []
        self.pending[job.llm][job_id] = None
        self.pending_version[job.llm] += 1
        self._touch()

    def _free_gpu(self, gid: int, now: float, keep_warm: bool) -> None:
        gpu = self.gpus[gid]
        gpu.job = None
        if keep_warm and gpu.state is GPUState.STARTING:
            self.starting[gpu.llm][gid] = None
            return  # still loading; becomes an idle warm GPU when ready
        if keep_warm:
            gpu.state = GPUState.IDLE
            gpu.idle_since = now
            self.idle[gpu.llm][gid] = None
        else:
            self.release(gid)

    def served(self, gid: int, at: float, resolution: float = 1.0) -> None:
        """An idle warm GPU served inference at ``at``: its idle time restarts there and it moves to the
        back of the idle order (released last, given to jobs first). Moves of less than ``resolution``
        seconds are ignored so a pod under steady traffic does not change the state every round."""
        gpu = self.gpus.get(gid)
        if gpu is None or gpu.state is not GPUState.IDLE or at - gpu.idle_since < resolution:
            return
        gpu.idle_since = at
        idle = self.idle[gpu.llm]
        idle.pop(gid, None)
        idle[gid] = None
        self._touch()

    def set_coserve_rates(self, rates: dict[int, float]) -> None:
        """The pods serving inference now and their co-serving rates (replaces the previous report; a
        changed report is a state change, so cached rounds are recomputed)."""
        rates = {g: r for g, r in rates.items() if g in self.gpus}
        if rates != self.coserve_rate:
            self.coserve_rate = rates
            self._touch()

    def release(self, gid: int) -> None:
        """An idle (or never-used) GPU returns to the cold pool."""
        gpu = self.gpus.pop(gid)
        if gpu.job is not None and gpu.job in self.jobs:
            job = self.jobs[gpu.job]
            if gid in job.gpus:
                job.gpus.remove(gid)
        self.idle[gpu.llm].pop(gid, None)
        self.starting[gpu.llm].pop(gid, None)
        self.pool_size[gpu.llm] -= 1
        self.coserve_rate.pop(gid, None)
        self._touch()
