"""The container contract of a worker pod: liveness, readiness (= warm) and the worker's record. Mounted
beside the serving API (/v1) on the serving port; Prometheus' /metrics is on the metrics port only
(engine/api/listeners.py), and this one answers 404 for it."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from elastune_contract.protocol import WorkerState
from elastune_worker.server.agent import Agent


def control_router(agent: Agent) -> APIRouter:
    router = APIRouter(tags=["worker"])

    @router.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz", responses={503: {"description": "not warm yet, or the model cannot load"}})
    def readyz() -> JSONResponse:
        rec = agent.snapshot()
        if agent.ready:
            return JSONResponse({"status": "ready", "state": rec["state"]})
        # What a probe's reader (kubectl describe, the startupProbe's events) needs to tell apart: still
        # loading the weights, going away (SIGTERM), or not able to serve (the reason says why).
        if agent.draining:
            status = "draining"
        elif rec["state"] == WorkerState.STARTING:
            status = "loading"
        else:
            status = "not ready"
        body = {"status": status, **{k: rec[k] for k in ("state", "reason", "message")}}
        return JSONResponse(body, status_code=503)

    @router.get("/health", responses={503: {"description": "not warm yet"}})
    def health() -> Response:
        """vLLM's health route, which peer routers (vllm-router, SGLang's smg) probe: 200 once warm."""
        return Response(status_code=200 if agent.ready else 503)

    @router.get("/status")
    def status() -> dict[str, object]:
        return agent.snapshot()

    return router
