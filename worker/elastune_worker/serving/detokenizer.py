"""Incremental detokenization with stop strings: each new token yields the text it adds; text that
could be the start of a stop string is held back until it is not; a stop string ends the output
before it (as OpenAI's API and vLLM do)."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        # The Rust tokenizer under a fast transformers tokenizer decodes ~10x faster than the wrapper.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=True))
            if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        )
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """(new text to emit, whether a stop string ended the output)."""
        self.ids.append(token_id)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return "", False
        stopped = False
        if self.stops:
            first = min((i for s in self.stops if (i := text.find(s)) != -1), default=-1)
            if first != -1:
                text, stopped = text[:first], True
        self.text = text
        limit = len(text) if stopped else max(self.sent, len(text) - self.hold)
        delta, self.sent = text[self.sent : limit], max(self.sent, limit)
        return delta, stopped

    def flush(self) -> str:
        """The held-back tail, once the request ended without a stop string."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
