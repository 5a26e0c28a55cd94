"""An endpoint's KV cache in the simulator: fixed-size token blocks, full blocks shared by prefix.

As in vLLM's and nano-vllm's block managers (DESIGN.md §5): a full block is identified by a hash of
its tokens and of every token before it (and the adapter: KV differs per adapter); a request admitted
with a prompt whose first blocks are cached takes references on them and computes the rest; blocks
nobody references stay cached until space is needed, then go least recently used first. Blocks being
filled (a prompt's tail, the output) are private to their request.

Simplification: a request reserves the blocks of its whole prompt and output at admission (the
simulator knows the output length; the engine preempts instead), so there is no preemption here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, salt: object = None, start: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (block i's hash covers blocks 0 … i)."""
    out: list[int] = []
    h = hash(("root", salt))
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        if i >= start:
            out.append(h)
    return out


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs: dict[int, int] = {}
        """Cached blocks: hash → references by running requests."""
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request references, least recently used first (evictable)."""
        self.private = 0
        """Blocks held by requests outside the cache (being filled)."""
        self.version = 0
        """Bumped whenever a block enters or leaves the cache."""

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self._refs) + self.private

    @property
    def free(self) -> int:
        """Blocks available now, counting idle cached blocks as evictable."""
        return self.num_blocks - self.used + len(self._idle)

    @property
    def referenced(self) -> int:
        """Blocks held by running requests (KV usage)."""
        return len(self._refs) - len(self._idle) + self.private

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    def __contains__(self, h: int) -> bool:
        return h in self._refs

    # -- admission and release ---------------------------------------------------------------------------
    def admit(self, hashes: Sequence[int], total_blocks: int) -> int | None:
        """Reserve ``total_blocks`` blocks for a request whose full prompt blocks are ``hashes``: the
        cached prefix is shared, the rest allocated privately. Returns the cached prefix in blocks, or
        None (nothing changed) when it does not fit even after evicting idle blocks."""
        hit = self.cached_prefix(hashes)
        need = total_blocks - hit
        # Idle blocks of our own prefix are about to be referenced: they cannot be evicted for us.
        own_idle = sum(1 for h in hashes[:hit] if self._refs[h] == 0)
        if need > self.num_blocks - self.used + len(self._idle) - own_idle:
            return None
        for h in hashes[:hit]:
            self._ref(h)
        while self.num_blocks - self.used < need:
            victim, _ = self._idle.popitem(last=False)
            del self._refs[victim]
            self.version += 1
        self.private += need
        return hit

    def register(self, hashes: Sequence[int]) -> int:
        """A request finished computing these full blocks (held privately until now): they enter the
        cache referenced by it. A block another request cached meanwhile is shared instead, and our
        private copy freed. Returns how many were new to the cache."""
        new = 0
        for h in hashes:
            self.private -= 1
            if h in self._refs:
                self._ref(h)
            else:
                self._refs[h] = 1
                new += 1
                self.version += 1
        return new

    def release(self, hashes: Sequence[int], private: int) -> None:
        """A request finished: drop its references (its blocks stay cached, most recently used) and its
        ``private`` blocks."""
        for h in hashes:
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._idle[h] = None
        self.private -= private
        assert self.private >= 0

    def _ref(self, h: int) -> None:
        if self._refs[h] == 0:
            del self._idle[h]
        self._refs[h] += 1

    def check(self) -> None:
        assert 0 <= self.used <= self.num_blocks, (self.used, self.num_blocks)
        assert all(self._refs[h] == 0 for h in self._idle)
        assert sum(1 for r in self._refs.values() if r == 0) == len(self._idle)
