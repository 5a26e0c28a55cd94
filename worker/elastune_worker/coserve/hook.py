"""A co-served job and its planner as the engine's ``StepHook`` (engine/hooks.py): each iteration the
planner sizes the job's share beside the inference tokens (FlexLLM §6.2), the job runs it (§6.1), and
the iteration's measured times refit the planner's latency lines online."""

from __future__ import annotations

from elastune_worker.coserve.planner import CoServePlanner, FinetuneJob, IterationPlan

DROP_PREFIX = "co-served finetuning failed: "


class CoServeHook:
    def __init__(self, job: FinetuneJob, planner: CoServePlanner) -> None:
        self.job, self.planner = job, planner
        self._last: tuple[IterationPlan, int] | None = None
        """The plan ``run`` ran and what ran of it, for ``observe``."""

    def pending(self) -> bool:
        return self.job.state() is not None

    def run(self, inference_tokens: int) -> int:
        self._last = None
        plan = self.planner.plan(inference_tokens, self.job.state())
        ran = self.job.run(plan)
        self._last = (plan, ran)
        return ran

    def observe(self, inference_s: float, hook_s: float) -> None:
        if self._last is not None:
            plan, ran = self._last
            self.planner.observe(plan, ran, inference_s, hook_s)

    def drop(self, reason: str) -> None:
        self.job.drop(DROP_PREFIX + reason)
