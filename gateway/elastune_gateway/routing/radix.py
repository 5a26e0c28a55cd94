"""The global radix tree over routed prompts' token sequences (Preble §4.2, "global prefix trees").

Each node holds a run of tokens with the same sharing property; a prompt is matched from the root
(prefix matching) and inserted by splitting the node where it diverges and adding the rest as a leaf.
For every node the tree records, as the paper does, the number of tokens, the set of endpoints caching
it, and per endpoint the requests that hit it within a window W (3 min, docs/design.md §5). A node with no
caching endpoint and no hit within W is removed.

Eviction bookkeeping. Preble's local schedulers tell the global one what they evict; vLLM-style engines
do not, so the tree models each endpoint's prefix cache itself: given the endpoint's KV capacity, an
insert that makes it hold more tokens than that evicts its least recently used nodes, leaves first, a
part of a node when a part is enough (§4.3's LRU). ``evict`` and ``remove_endpoint`` take reports
when there are any. The model is approximate by design — the engine also spends KV on running requests
and evicts whole blocks — and the gateway's routing state is rebuilt from traffic after a restart.

Per endpoint the nodes it caches are kept in a linked list in LRU order with the invariant that a
node's children (cached there) come before it: a hit touches its path from the leaf up, and a split
places the new head right after the tail it was cut from, so the front of the order is always a leaf
of that endpoint's cached subtree.

Bounded size: above ``max_nodes`` nodes, uncached nodes go first (oldest hit first, window or not),
then the endpoint caching the most tokens evicts its LRU leaf, until the tree fits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

WINDOW_SECONDS = 180.0
"""Preble's history window W: hits older than this no longer count (docs/design.md §5: 3 min)."""


class _Order:
    """One endpoint's cached nodes, least recently used first: a doubly linked list (O(1) append,
    removal and insertion after a given node). ``None`` is the sentinel."""

    __slots__ = ("_next", "_prev")

    def __init__(self) -> None:
        self._next: dict[Node | None, Node | None] = {None: None}
        self._prev: dict[Node | None, Node | None] = {None: None}

    def __contains__(self, node: Node) -> bool:
        return node in self._next

    def __len__(self) -> int:
        return len(self._next) - 1

    def __iter__(self) -> Iterator[Node]:
        node = self._next[None]
        while node is not None:
            yield node
            node = self._next[node]

    def first(self) -> Node | None:
        return self._next[None]

    def insert_after(self, anchor: Node | None, node: Node) -> None:
        after = self._next[anchor]
        self._next[anchor] = node
        self._prev[node] = anchor
        self._next[node] = after
        self._prev[after] = node

    def remove(self, node: Node) -> None:
        before, after = self._prev.pop(node), self._next.pop(node)
        self._next[before] = after
        self._prev[after] = before

    def move_to_end(self, node: Node) -> None:
        """Most recently used (appended when absent)."""
        if node in self._next:
            self.remove(node)
        self.insert_after(self._prev[None], node)


class Node:
    __slots__ = ("children", "endpoints", "hits", "last_hit", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], parent: Node | None) -> None:
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.endpoints: set[str] = set()
        self.hits: dict[str, deque[float]] = {}
        """Per endpoint: times of the requests routed there that hit this node (within the window)."""
        self.last_hit = float("-inf")

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"Node({len(self.tokens)} tokens, on {sorted(self.endpoints)})"


@dataclass(slots=True)
class Match:
    """A prompt matched against the tree: the path of nodes cached somewhere, and how far into each."""

    prompt_len: int
    path: list[tuple[Node, int]] = field(default_factory=list)
    """(node, tokens of it matched) from the root down; the last one may be matched in part."""

    @property
    def matched(self) -> int:
        """Prompt tokens cached on at least one endpoint (Preble's cached_len)."""
        return sum(n for _, n in self.path)

    @property
    def missed(self) -> int:
        return self.prompt_len - self.matched

    def cached_on(self, endpoint: str) -> int:
        """Leading prompt tokens cached on ``endpoint`` (a prefix: a node's children are cached only
        where the node is)."""
        total = 0
        for node, n in self.path:
            if endpoint not in node.endpoints:
                break
            total += n
        return total

    def key_portion(self) -> tuple[Node, int] | None:
        """Preble's key portion: the matched node with the most matched tokens (the deepest among
        equal ones, the more specific prefix); None when nothing matched."""
        best: tuple[Node, int] | None = None
        for node, n in self.path:
            if best is None or n >= best[1]:
                best = (node, n)
        return best

    def nodes(self) -> set[Node]:
        return {node for node, _ in self.path}


def _common(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class GlobalRadixTree:
    def __init__(self, window_seconds: float = WINDOW_SECONDS, max_nodes: int = 200_000) -> None:
        if window_seconds <= 0 or max_nodes < 2:
            raise ValueError("window_seconds must be > 0 and max_nodes >= 2")
        self.window = window_seconds
        self.max_nodes = max_nodes
        self.root = Node((), None)
        self._lru: dict[str, _Order] = {}
        self._cached: dict[str, int] = {}
        self._orphans: set[Node] = set()
        """Nodes cached nowhere, kept for their hits within the window."""
        self.num_nodes = 0
        """Nodes besides the root."""
        self.prune_every = 256
        """Inserts between two sweeps of uncached nodes whose window has passed."""
        self._inserts = 0

    # -- reading ---------------------------------------------------------------------------------------
    def match(self, tokens: tuple[int, ...]) -> Match:
        result = Match(len(tokens))
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None or not child.endpoints:
                break
            n = _common(child.tokens, tokens, pos)
            result.path.append((child, n))
            if n < len(child.tokens):
                break
            node, pos = child, pos + n
        return result

    def cached_tokens(self, endpoint: str) -> int:
        """Tokens the tree believes ``endpoint`` caches."""
        return self._cached.get(endpoint, 0)

    def endpoints(self) -> list[str]:
        return [e for e, n in self._cached.items() if n > 0]

    def hits(self, node: Node, endpoint: str, now: float) -> int:
        """Requests routed to ``endpoint`` that hit ``node`` within the window before ``now``."""
        times = node.hits.get(endpoint)
        if not times:
            return 0
        horizon = now - self.window
        while times and times[0] < horizon:
            times.popleft()
        return len(times)

    def lru_nodes(self, endpoint: str) -> Iterator[Node]:
        """``endpoint``'s cached nodes, least recently used first (leaves before their parents)."""
        return iter(self._lru.get(endpoint, ()))

    def eviction_victims(
        self, endpoint: str, tokens: int, protect: set[Node] | None = None
    ) -> list[tuple[Node, int]]:
        """What ``endpoint`` would evict to free ``tokens`` tokens, LRU first, without evicting:
        (node, tokens taken from it), the last one possibly a part. Nodes in ``protect`` (the request's
        own matched path) are kept."""
        victims: list[tuple[Node, int]] = []
        need = tokens
        for node in self.lru_nodes(endpoint):
            if need <= 0:
                break
            if protect and node in protect:
                continue
            take = min(len(node), need)
            victims.append((node, take))
            need -= take
        return victims

    # -- writing ---------------------------------------------------------------------------------------
    def insert(
        self,
        tokens: tuple[int, ...],
        endpoint: str,
        now: float,
        capacity: int | None = None,
        count_hit: bool = True,
    ) -> list[Node]:
        """A request with these tokens was routed to ``endpoint`` at ``now``: it caches them all and
        hits every node on their path (``count_hit`` False: cached, used, but not a new request — a
        finished request's output added to its prompt). With ``capacity`` (the endpoint's KV tokens)
        the endpoint then evicts LRU nodes until it fits. Returns the path."""
        path: list[Node] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = Node(tokens[pos:], node)
                node.children[tokens[pos]] = leaf
                self.num_nodes += 1
                path.append(leaf)
                break
            n = _common(child.tokens, tokens, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            path.append(child)
            node, pos = child, pos + n
        lru = self._lru.setdefault(endpoint, _Order())
        for node in path:
            if endpoint not in node.endpoints:
                node.endpoints.add(endpoint)
                self._cached[endpoint] = self._cached.get(endpoint, 0) + len(node)
                self._orphans.discard(node)
            if count_hit:
                times = node.hits.setdefault(endpoint, deque())
                while times and times[0] < now - self.window:
                    times.popleft()
                times.append(now)
            node.last_hit = max(node.last_hit, now)
        for node in reversed(path):  # leaf first, so that parents stay behind their children
            lru.move_to_end(node)
        if capacity is not None:
            self._fit(endpoint, capacity, now, keep=set(path))
        self._inserts += 1
        if self.num_nodes > self.max_nodes:
            self._shrink(now)
        elif self._inserts % self.prune_every == 0:
            self.prune(now)
        return path

    def evict(self, endpoint: str, tokens: int, now: float) -> int:
        """``endpoint`` evicted (or must evict) ``tokens`` tokens, LRU first. Returns tokens evicted."""
        freed = 0
        lru = self._lru.get(endpoint)
        while lru and freed < tokens:
            node = lru.first()
            assert node is not None
            freed += self._evict_node(endpoint, node, tokens - freed, now)
        if self.num_nodes > self.max_nodes:  # a partial eviction splits a node
            self._shrink(now)
        return freed

    def remove_endpoint(self, endpoint: str, now: float) -> None:
        """The endpoint went away (or dropped its cache): it caches nothing any more."""
        lru = self._lru.pop(endpoint, None)
        self._cached.pop(endpoint, None)
        for node in list(lru or ()):
            node.endpoints.discard(endpoint)
            node.hits.pop(endpoint, None)
            if not node.endpoints:
                self._orphans.add(node)
        self.prune(now)

    def prune(self, now: float, force: bool = False) -> int:
        """Remove nodes cached nowhere and not hit within the window (all uncached ones if ``force``),
        leaves first. Returns nodes removed."""
        horizon = now - self.window
        removed = 0
        for node in sorted(self._orphans, key=lambda n: n.last_hit):
            if node.endpoints or (not force and node.last_hit >= horizon):
                continue
            removed += self._remove_subtree_if_orphan(node)
        return removed

    # -- internals -------------------------------------------------------------------------------------
    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens: a new parent holds the head; ``node`` keeps the tail and
        its place in every LRU order, the head comes right after it (as recent as the tail, before every
        ancestor). Returns the head."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        head = Node(node.tokens[:at], parent)
        head.endpoints = set(node.endpoints)
        head.hits = {e: deque(t) for e, t in node.hits.items()}
        head.last_hit = node.last_hit
        parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.parent = head
        head.children[node.tokens[0]] = node
        self.num_nodes += 1
        for e in head.endpoints:
            self._lru[e].insert_after(node, head)
        if not head.endpoints:
            self._orphans.add(head)
        return head

    def _fit(self, endpoint: str, capacity: int, now: float, keep: set[Node]) -> None:
        lru = self._lru[endpoint]
        while self._cached.get(endpoint, 0) > capacity:
            node = next((n for n in lru if n not in keep), None)
            if node is None:
                return  # only the request's own path is left: a prompt larger than the cache
            self._evict_node(endpoint, node, self._cached[endpoint] - capacity, now)

    def _evict_node(self, endpoint: str, node: Node, tokens: int, now: float) -> int:
        """Evict ``node`` from ``endpoint``, or only its last ``tokens`` tokens when that is less."""
        if tokens < len(node):
            self._split(node, len(node) - tokens)  # ``node`` keeps the tail, the head its place
        node.endpoints.discard(endpoint)
        self._lru[endpoint].remove(node)
        self._cached[endpoint] -= len(node)
        if not node.endpoints:
            self._orphans.add(node)
            if node.last_hit < now - self.window:
                self._remove_subtree_if_orphan(node)
        return len(node)

    def _remove_subtree_if_orphan(self, node: Node) -> int:
        """Remove an uncached leaf, then its ancestors while they become uncached leaves too."""
        removed = 0
        while node.parent is not None and not node.children and not node.endpoints and node in self._orphans:
            parent = node.parent
            del parent.children[node.tokens[0]]
            self._orphans.discard(node)
            self.num_nodes -= 1
            removed += 1
            node = parent
        return removed

    def _shrink(self, now: float) -> None:
        self.prune(now, force=True)
        while self.num_nodes > self.max_nodes and self._cached:
            endpoint = max(self._cached, key=lambda e: self._cached[e])
            lru = self._lru[endpoint]
            node = lru.first()
            if node is None:
                break
            self._evict_node(endpoint, node, len(node), now)
            self._remove_subtree_if_orphan(node)

    def check(self) -> None:
        """Assert the invariants (tests): counts, prefix property, LRU order, orphan set."""
        counted: dict[str, int] = {}
        nodes = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for first, child in node.children.items():
                assert child.parent is node and child.tokens and child.tokens[0] == first
                assert child.endpoints <= (node.endpoints if node is not self.root else child.endpoints)
                assert (not child.endpoints) == (child in self._orphans)
                for e in child.endpoints:
                    counted[e] = counted.get(e, 0) + len(child)
                nodes += 1
                stack.append(child)
        assert nodes == self.num_nodes, (nodes, self.num_nodes)
        assert {e: n for e, n in counted.items() if n} == {e: n for e, n in self._cached.items() if n}
        for e, lru in self._lru.items():
            seen: set[Node] = set()
            for node in lru:
                assert e in node.endpoints
                assert all(c in seen for c in node.children.values() if e in c.endpoints), "LRU order"
                seen.add(node)
            assert len(seen) == len(lru)
