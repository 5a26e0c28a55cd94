"""Incremental detokenization with stop strings: each new token yields the text it adds; text that
could be the start of a stop string is held back until it is not; a stop string ends the output
before it (as OpenAI's API and vLLM do)."""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5
"""Prompt tokens kept in front of the output when decoding its window (vLLM keeps 5 too)."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...], prompt_ids: list[int] | None = None) -> None:
        # The Rust tokenizer under a fast transformers tokenizer decodes ~10x faster than the wrapper.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode = (
            (lambda ids: backend.decode(ids, skip_special_tokens=True))
            if backend is not None
            else (lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        )
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        # The window starts in the prompt's last tokens: decoders that drop a leading space at the
        # start of a sequence (SentencePiece) then render the first output token as it follows.
        self.ids: list[int] = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """(new text to emit, whether a stop string ended the output).

        Decodes a short window, not the whole output (which would cost O(n) per token): the text of
        ids[prefix_offset:] minus that of ids[prefix_offset:read_offset] is what the new token adds, as
        transformers' and vLLM's streaming detokenizers do."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", False  # an incomplete UTF-8 sequence, or a token without text: wait
        searched_from = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        stopped = False
        if self.stops:
            hits = [i for s in self.stops if (i := self.text.find(s, searched_from)) != -1]
            if hits:
                self.text, stopped = self.text[: min(hits)], True
        limit = len(self.text) if stopped else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : limit], max(self.sent, limit)
        return delta, stopped

    def flush(self) -> str:
        """The held-back tail, once the request ended without a stop string."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
