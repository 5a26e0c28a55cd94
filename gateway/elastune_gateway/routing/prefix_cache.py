"""The gateway's model of its endpoints' prefix caches, shared by the prefix-aware policies: the global
radix tree plus each endpoint's published KV capacity (the tree evicts per endpoint, LRU, within it)."""

from __future__ import annotations

from collections.abc import Sequence

from .policy import EndpointView, RequestView
from .radix import GlobalRadixTree


class PrefixCacheModel:
    def __init__(self, window_seconds: float, max_nodes: int) -> None:
        self.tree = GlobalRadixTree(window_seconds, max_nodes)
        self.capacity: dict[str, int] = {}

    def observe(self, endpoints: Sequence[EndpointView]) -> None:
        for e in endpoints:
            self.capacity[e.id] = e.kv_capacity_tokens

    def routed(self, request: RequestView, endpoint: str, now: float) -> None:
        """The endpoint now caches the prompt (a hit for the nodes it shares)."""
        if request.tokens:
            self.tree.insert(request.tokens, endpoint, now, self.capacity.get(endpoint))

    def finished(
        self, request: RequestView, endpoint: str, now: float, output_token_ids: tuple[int, ...]
    ) -> None:
        """The engine caches prompt + output: a next turn of the conversation can reuse both."""
        if request.tokens and output_token_ids:
            self.tree.insert(
                request.tokens + output_token_ids, endpoint, now, self.capacity.get(endpoint), count_hit=False
            )

    def forget(self, endpoint: str, now: float) -> None:
        """The endpoint left the pool: drop what it cached."""
        self.tree.remove_endpoint(endpoint, now)
        self.capacity.pop(endpoint, None)
