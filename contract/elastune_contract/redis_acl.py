"""Redis users per role (docs/design.md §6 Tenancy, issue 25 item 4): what the operator, the gateway and the
workers may do on the control bus, as Redis 7 ACL rules over the key layout of ``protocol.py`` and the
gradient keys of the worker's all-reduce (``elastune:{job}:{step}:grad|merged:...``).

- operator: every command on the bus's keys (``{ns}:*``) except the dangerous ones (FLUSHALL, FLUSHDB,
  CONFIG, KEYS, DEBUG, SHUTDOWN, ...), plus ACL SETUSER/DELUSER/GETUSER: it creates a user per WarmPool
  (issue 39 item 2, ``elastune_operator.k8s.redis_users``), which is what the pools' workers use.
- gateway: reads the registry (worker records, pool records) and writes only its own traffic signals:
  request counts per window and demand for a pool at zero; SREM of expired ids from the worker set (what
  ``Bus.workers`` prunes); reads the API key map (hashes and scopes, ``api_keys.py``) and counts per-key
  usage under ``{ns}:ratelimit:*``.
- worker (workers run by hand; a WarmPool's pods get a user of their own): its registry record and the
  worker set, its assignment queue (BLPOP), job events (XADD) and cancel flags (read), placements (read,
  and DEL: ``Bus.forget_worker`` on exit), gradients. It cannot FLUSHALL, CONFIG, ACL, write pool records,
  placements, assignments, demand or request counts, and cannot read the API key map.

Known limit: all workers share the worker user, so one worker can still overwrite another worker's
record under ``{ns}:worker:*`` (Redis ACLs cannot tie a key to the client). Its address is not trusted
for that: the gateway forwards only to the addresses the pool records (operator-written, read-only here)
vouch for (``ServingPoolRecord.vouched``); what such a write can still do is misstate that worker's load
or adapters. Worker keys now carry the pod's namespace (``{ns}:worker:<namespace>/<pod>``, and so do
``assign:`` and ``placement:``: ``protocol.pod_worker_id``), so the patterns above match them unchanged
and the operator builds a user per WarmPool on them (``elastune_operator.k8s.redis_users``): the pools'
workers use that, not this worker role, which is left for workers run by hand.

``acl_file`` writes the users as an ACL file (``--aclfile``) or ``user`` lines of redis.conf, with
SHA-256 hashed passwords; clients name their user with ``ELASTUNE_REDIS_USERNAME`` (or in the URL).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from elastune_contract.protocol import USERNAME_ENV

__all__ = ["DEFAULT_USERS", "ROLES", "USERNAME_ENV", "Role", "acl_file", "acl_rules", "password_hash"]

Role = Literal["operator", "gateway", "worker"]
ROLES: tuple[Role, ...] = ("operator", "gateway", "worker")
DEFAULT_USERS: dict[Role, str] = {
    "operator": "elastune-operator",
    "gateway": "elastune-gateway",
    "worker": "elastune-worker",
}

# What every client does on connect (redis-py: HELLO/AUTH, CLIENT SETINFO) and to check the server.
_CONNECT = "+ping +hello +auth +client|setname +client|getname +client|id"


def acl_rules(role: Role, namespace: str = "elastune") -> str:
    """The rules of ``role``'s user (after ``user <name> on <password>``): selectors in parentheses, each
    a set of commands over a set of key patterns; a command must fit one of them with all its keys."""
    ns = namespace
    if role == "operator":
        keys = " ".join(dict.fromkeys([f"~{ns}:*", "~elastune:*"]))  # the bus, and the gradient keys
        # ACL SETUSER/DELUSER/GETUSER: a Redis user per WarmPool (elastune_operator.k8s.redis_users).
        acl = "+acl|setuser +acl|deluser +acl|getuser"
        return f"resetkeys resetchannels {keys} -@all +@all -@dangerous {acl} {_CONNECT}"
    if role == "gateway":
        selectors = [
            f"%R~{ns}:workers %R~{ns}:worker:* +smembers +mget",
            f"~{ns}:workers +srem",
            f"%R~{ns}:serving-pools +hgetall +hlen",
            f"~{ns}:requests:* +hincrby +expire +hgetall",
            f"~{ns}:demand:* +set +get",
            # API keys (api_keys.py): the hashed key map, read only; per-key counters of rate limits.
            f"%R~{ns}:api-keys +hgetall",
            f"~{ns}:ratelimit:* +incr +incrby +expire +get +mget",
        ]
    elif role == "worker":
        selectors = [
            f"~{ns}:worker:* +set",
            f"~{ns}:workers +sadd +srem",
            f"~{ns}:assign:* +blpop",
            f"~{ns}:job:*:events +xadd +expire",
            f"%R~{ns}:job:*:cancel:* +exists",
            f"%R~{ns}:placement:* +hgetall",
            # Bus.forget_worker on exit: one DEL of its record, queue and placement.
            f"~{ns}:worker:* ~{ns}:assign:* ~{ns}:placement:* +del",
            "~elastune:*:grad:* ~elastune:*:merged:* +set +get +mget +del",
        ]
    else:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    # MULTI/EXEC: redis-py pipelines are transactions by default.
    base = f"resetkeys resetchannels -@all {_CONNECT} +multi +exec +discard"
    return " ".join([base, *(f"({s})" for s in selectors)])


def password_hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def acl_file(
    passwords: dict[Role, str],
    namespace: str = "elastune",
    users: dict[Role, str] | None = None,
) -> str:
    """ACL file lines for the roles in ``passwords`` (their users ``users`` or DEFAULT_USERS); the default
    user is turned off (no anonymous or shared full-rights password)."""
    names = {**DEFAULT_USERS, **(users or {})}
    lines = ["user default off resetkeys -@all"]
    for role, password in passwords.items():
        if not password:
            raise ValueError(f"the {role} password is empty")
        lines.append(f"user {names[role]} on {password_hash(password)} {acl_rules(role, namespace)}")
    return "\n".join(lines) + "\n"
