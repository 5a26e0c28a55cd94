"""The container contract of a worker pod: liveness, readiness (= warm), Prometheus metrics and
the worker's record. Mounted beside the serving API (/v1) on the pod's one port."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elastune_contract.protocol import WorkerState
from elastune_worker.server.agent import Agent
from elastune_worker.server.metrics import WorkerMetrics


def control_router(agent: Agent, metrics: WorkerMetrics) -> APIRouter:
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

    @router.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/status")
    def status() -> dict[str, object]:
        return agent.snapshot()

    return router
