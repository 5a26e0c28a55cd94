"""What the engine gives back for a request each step: its ``RequestOutput`` (pure: the HTTP API reads it
without importing the engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str
    """Text added by this step (stop strings trimmed)."""
    finished: bool
    finish_reason: str | None
    """stop | length | abort once finished."""
    prompt_tokens: int
    completion_tokens: int
    """Generated tokens so far, this step's included."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    error: str | None = None
    """Set when this request failed inside a step (finished, reason abort): the others went on."""


class RequestFailed(RuntimeError):
    """One request failed inside a step (sampling, its adapter or soft prompt); the others go on."""
