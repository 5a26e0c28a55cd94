"""SSJF's output-length prediction, asked of the predictor service (the model runs where torch may
run: ``python -m elastune_ssjf``), so the gateway stays torch-free.

A prediction that fails or takes longer than its timeout is skipped — the request is routed and queued
without one (FCFS among such requests) — never delayed or failed because of it.
"""

from __future__ import annotations

import logging

import httpx

log = logging.getLogger("elastune.gateway")


class LengthPredictor:
    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.url = url.rstrip("/") + "/v1/predict_length"
        self.client = client
        self.timeout_s = timeout_s
        self.failures = 0

    async def predict(self, prompt: str) -> int | None:
        try:
            resp = await self.client.post(self.url, json={"prompts": [prompt]}, timeout=self.timeout_s)
            resp.raise_for_status()
            value = resp.json()["predicted_output_tokens"][0]
            return max(1, int(value))
        except Exception as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "length prediction failed (%d so far), the request goes FCFS: %s", self.failures, exc
                )
            return None
