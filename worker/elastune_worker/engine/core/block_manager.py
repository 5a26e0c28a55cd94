"""The paged KV cache's bookkeeping, with prefix caching (pure: no torch).

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A full block is identified by a chain
hash of (the previous block's hash, its tokens, an extra key such as a LoRA adapter), so two requests
whose prompts share a prefix share its blocks. Blocks nobody references stay in the cache, in a
free queue ordered least-recently-freed first: a new allocation takes the head, evicting that block's
cached content (LRU). A partial block is never shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from elastune_worker.engine.core.sequence import Sequence


def block_hash(parent: bytes | None, tokens: tuple[int, ...], extra_key: str | None) -> bytes:
    """SHA-256 of (parent digest, the block's tokens, extra key). Python's hash() of integer tuples is
    predictable and collides by construction, so a crafted prompt could be served another request's
    KV blocks; vLLM moved to SHA-256 for the same reason."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    h.update(b"\x00" if extra_key is None else b"\x01" + extra_key.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- queries ------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Share of blocks held by requests (cached but unreferenced blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- admission: the longest cached prefix -------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Take the cached blocks of the longest cached prefix of ``seq`` (ref counts +1); returns the
        tokens they cover. At least one token is left to compute: its logits are needed."""
        if seq.block_table:
            raise AssertionError(f"{seq.request_id} already holds blocks")
        hits = self._cached_prefix(seq)
        for b in hits:
            self._take(b)
        seq.block_table = hits
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        return seq.num_computed_tokens

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """The tokens ``match_prefix`` would find cached for ``seq`` now (nothing is taken)."""
        return len(self._cached_prefix(seq)) * self.block_size

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, leaving at least its last token out."""
        self._extend_hashes(seq)
        hits: list[int] = []
        if self.enable_prefix_caching:
            for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
                b = self.cached.get(h)
                if b is None:
                    break
                hits.append(b)
        return hits

    def count_admission(self, seq: Sequence) -> None:
        """Prefix-cache statistics of an admitted request (a failed admission retried counts once)."""
        self.queried_tokens += len(seq.prompt_token_ids)
        self.hit_tokens += min(seq.num_computed_tokens, len(seq.prompt_token_ids))

    # -- growth -------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for ``seq``'s next ``num_new_tokens`` tokens; False (nothing taken) if too few are free."""
        need = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)  # least recently freed: its cached content is evicted
            old = self.hash_of[b]
            if old is not None:
                if self.cached.get(old) == b:
                    del self.cached[old]
                self.hash_of[b] = None
            self.ref_count[b] = 1
            seq.block_table.append(b)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that ``seq`` filled to the prefix cache (after a step computed them)."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        self._extend_hashes(seq)
        for i in range(seq.num_registered_blocks, full):
            h, b = seq.block_hashes[i], seq.block_table[i]
            if h not in self.cached:
                self.cached[h] = b
                self.hash_of[b] = h
        seq.num_registered_blocks = full

    # -- release ------------------------------------------------------------------------------------
    def free_blocks(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Unreferenced cached blocks join the free queue's tail (evicted last,
        tail blocks of the sequence first), uncached ones its head (reused first: they hold nothing)."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise AssertionError(f"block {b} freed twice")
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for b in list(self.free):
            if self.hash_of[b] is not None:
                self.cached.pop(self.hash_of[b], None)  # type: ignore[arg-type]
                self.hash_of[b] = None

    # -- internals ----------------------------------------------------------------------------------
    def _take(self, b: int) -> None:
        if self.ref_count[b] == 0:
            del self.free[b]
        self.ref_count[b] += 1

    def _extend_hashes(self, seq: Sequence) -> None:
        tokens = seq.all_token_ids
        bs = self.block_size
        for i in range(len(seq.block_hashes), len(tokens) // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(block_hash(parent, tuple(tokens[i * bs : (i + 1) * bs]), seq.extra_key))

    def check(self, live: list[Sequence]) -> None:
        """Invariants (O(blocks in use), plus one C-speed sum over all ref counts): each live block's ref
        count equals the references the sequences hold, every other block is in the free queue, and
        no other block has a ref count (a free block that has one would not leave the free queue when
        taken, and could be handed to a second request while the first still writes it)."""
        refs: dict[int, int] = {}
        for seq in live:
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        for b, n in refs.items():
            assert self.ref_count[b] == n, f"block {b}: ref count {self.ref_count[b]}, referenced {n} times"
            assert b not in self.free, f"block {b} is referenced but in the free queue"
        assert len(refs) + len(self.free) == self.num_blocks, "a block is neither free nor referenced"
        # the referenced blocks' counts are exact (above) and none is negative, so this is the rest's 0
        stray = sum(self.ref_count) - sum(refs.values())
        assert stray == 0, f"unreferenced blocks hold {stray} reference(s): a free block has a ref count"
