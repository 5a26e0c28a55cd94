"""Each WarmPool's share of Redis, checked by the control plane (issue 39 item 2): Redis ACLs confine a
pool's user to its keys but cannot bound how much it writes there (no per-user memory or value limit
exists; ``proto-max-bulk-len`` caps one value for every client, ``maxmemory`` the whole server). So the
operator counts, every ``CHECK_S``, the bytes (``MEMORY USAGE``) of the keys each pool's user may write
(``redis_users.pool_acl_rules``): its workers' records, and the event streams and gradients of the jobs of
the namespaces it admits. A pool over its budget loses its write rights at once (its user keeps only its
reads: ACL changes apply to open connections too), the largest of its keys are deleted until it is back
under half its budget, and it stays cut off (Ready=False, RedisBudgetExceeded) until someone asks for a
new password (the rotate annotation: ``redis_users``), since its image is what wrote them. One SCAN of the
keyspace per check serves every pool.

What this does not do: stop a fast flood before the check sees it. Between two checks a pool can write as
fast as Redis takes it, up to ``maxmemory``, when every client's writes fail (``noeviction``) until the
check cuts it off and deletes its keys. Keys of one namespace's jobs are charged to every pool that admits
that namespace (Redis cannot say which client wrote a key).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from elastune_contract.api.warmpool import WarmPool
from elastune_contract.protocol import pool_id
from elastune_operator.k8s.redis_users import admitted

log = logging.getLogger("elastune.redis_budget")

CHECK_S = 15.0
"""Seconds between two counts of the keyspace (one SCAN, one MEMORY USAGE per candidate key)."""
SCAN_COUNT = 1000


@dataclass
class BudgetVerdict:
    """What one check found: bytes per pool, and the pools it cut off."""

    used: dict[str, int] = field(default_factory=dict)
    cut: list[str] = field(default_factory=list)


def _owners(key: str, bus_ns: str, pools: dict[str, WarmPool]) -> list[str]:
    """The pool ids whose user may write ``key`` (the write selectors of ``pool_acl_rules``)."""
    out = []
    for pid, pool in pools.items():
        ns, name = pool.metadata.namespace or "default", pool.metadata.name or ""
        if key.startswith(f"{bus_ns}:worker:{ns}/{name}-"):
            out.append(pid)
            continue
        for adm in admitted(pool):
            job = key.startswith(f"{bus_ns}:job:") and key.endswith(":events")
            if job and (adm == "*" or key.startswith(f"{bus_ns}:job:{adm}/")):
                out.append(pid)
                break
            grad = key.startswith("elastune:") and (":grad:" in key or ":merged:" in key)
            if grad and (adm == "*" or key.startswith(f"elastune:{adm}.")):
                out.append(pid)
                break
    return out


class RedisBudget:
    """The budget check; ``suspend(pool)`` cuts a pool user's write rights (``PoolRedisUsers.suspend``)."""

    def __init__(
        self,
        redis_client: redis.Redis,
        bus_ns: str,
        budget_bytes: int,
        suspend: Callable[[WarmPool], None],
    ) -> None:
        self.redis = redis_client
        self.bus_ns = bus_ns
        self.budget = budget_bytes
        self.suspend = suspend

    def check(self, pools: list[WarmPool]) -> BudgetVerdict:
        by_id = {pool_id(p.metadata.namespace or "default", p.metadata.name or ""): p for p in pools}
        sizes: dict[str, dict[str, int]] = {pid: {} for pid in by_id}
        cursor = 0
        while True:
            cursor, keys = self.redis.scan(cursor, count=SCAN_COUNT)
            owned = [(str(k), o) for k in keys if (o := _owners(str(k), self.bus_ns, by_id))]
            if owned:
                pipe = self.redis.pipeline(transaction=False)
                for k, _ in owned:
                    pipe.memory_usage(k, samples=0)
                for (k, owners), size in zip(owned, pipe.execute(), strict=True):
                    for pid in owners:
                        sizes[pid][k] = int(size or 0)
            if cursor == 0:
                break
        verdict = BudgetVerdict(used={pid: sum(s.values()) for pid, s in sizes.items()})
        for pid, used in verdict.used.items():
            if used > self.budget:
                self.suspend(by_id[pid])  # first: no more writes while its keys go
                verdict.cut.append(pid)
                self._shed(pid, sizes[pid])
                log.warning(
                    "WarmPool %s wrote %d bytes to Redis, over its %d: cut off", pid, used, self.budget
                )
        return verdict

    def _shed(self, pid: str, sizes: dict[str, int]) -> None:
        """Delete the pool's largest keys until it holds at most half its budget."""
        left = sum(sizes.values())
        doomed = []
        for key, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
            if left <= self.budget // 2:
                break
            doomed.append(key)
            left -= size
        if doomed:
            self.redis.delete(*doomed)
            sizes.clear()
            log.warning("WarmPool %s: deleted %d of its Redis keys", pid, len(doomed))
