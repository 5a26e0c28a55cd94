"""The output-length predictor behind HTTP, for the gateway (which stays torch-free).

    python -m elastune_ssjf [--host 127.0.0.1] [--port 8090] [--model DIR] [--threads N]

``POST /v1/predict_length`` with ``{"prompts": ["...", ...]}`` answers
``{"predicted_output_tokens": [int, ...], "model": "ssjf-predictor-v1"}`` in the prompts' order; a bad
body is a 400 with an OpenAI-shaped error (``{"error": {"message", "type", "param", "code"}}``).
``GET /healthz`` says it is up. Without ``--model`` the cached predictor is used, built first (about a
minute on 2 cores) when the cache has none; the server only listens once it is loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("elastune.ssjf")

MAX_PROMPTS = 256
"""Prompts per request at most (each costs an encoder forward on the service's cores)."""
MAX_PROMPT_CHARS = 1_000_000
"""A prompt longer than this is refused rather than tokenized (only 510 of its tokens are used)."""


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompts: list[str] = Field(
        min_length=1, max_length=MAX_PROMPTS, description="The prompts, as the LLM will see them."
    )


class PredictResponse(BaseModel):
    predicted_output_tokens: list[int]
    model: str


def create_app(get_predictor: Callable[[], Any]) -> FastAPI:
    """``get_predictor()`` returns something with ``.name`` and ``.predict(list[str]) -> list[int]``."""
    from elastune_contract.openai_api.errors import APIError
    from elastune_contract.openai_api.handlers import install_error_handlers

    app = FastAPI(title="Elastune SSJF output-length predictor")
    install_error_handlers(app, log)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "model": get_predictor().name}

    @app.post("/v1/predict_length", response_model=PredictResponse)
    def predict_length(body: PredictRequest) -> PredictResponse:
        for i, prompt in enumerate(body.prompts):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise APIError(400, f"prompts[{i}] has more than {MAX_PROMPT_CHARS} characters", "prompts")
        predictor = get_predictor()
        return PredictResponse(predicted_output_tokens=predictor.predict(body.prompts), model=predictor.name)

    return app


def load_predictor(model: Path | None, cache_dir: Path | None = None) -> Any:
    """The predictor at ``model``, or the cached one, built first if the cache has none (logged)."""
    from elastune_ssjf.build import ensure_predictor, is_complete, model_dir
    from elastune_ssjf.predictor import LengthPredictor

    if model is None:
        target = model_dir(cache_dir)
        if not is_complete(target):
            log.info("building the SSJF predictor into %s (not in the cache; about a minute)", target)
            t0 = time.perf_counter()
            ensure_predictor(cache_dir)
            log.info("built the SSJF predictor in %.1f s", time.perf_counter() - t0)
        model = target
    predictor = LengthPredictor.load(model)
    log.info("SSJF predictor %s loaded from %s", predictor.name, model)
    return predictor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastune_ssjf", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8090")))
    p.add_argument("--model", type=Path, help="a built predictor directory (default: the cache's)")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $ELASTUNE_CACHE or ~/.cache/elastune)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import uvicorn

    torch.set_num_threads(max(1, args.threads))
    try:
        predictor = load_predictor(args.model, args.cache_dir)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    app = create_app(lambda: predictor)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
