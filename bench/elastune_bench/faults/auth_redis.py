"""Experiments on the registry and the keys: Redis flushed, down, refusing writes, holding garbage; API keys
missing or wrong. Authentication must not follow Redis's liveness either way (issue 38 item 2)."""

from __future__ import annotations

import re
import time

from elastune_contract.protocol import events_key, pools_key, worker_key

from .stack import (
    DOOMED_KEY,
    JOB,
    KEY,
    MODEL,
    Outcome,
    Plan,
    Stack,
    auth,
    summary,
    traffic,
    wait_until,
)


def _code(stack: Stack, key: str | None, model: str = MODEL) -> tuple[int, str]:
    headers = auth(key) if key else {"Authorization": ""}
    body = {"model": model, "prompt": "3 km ->", "max_tokens": 2, "temperature": 0}
    r = stack.http.post(stack.url + "/v1/completions", json=body, headers=headers)
    return r.status_code, r.headers.get("retry-after", "")


def exp_bad_key(stack: Stack, plan: Plan) -> Outcome:
    """No key, a key never issued and a valid one: 401, 401, 200."""
    none, wrong, valid = (_code(stack, k)[0] for k in (None, "sk-never-issued", KEY))
    detail = f"no key: {none}; a key never issued: {wrong}; a valid key: {valid}"
    return Outcome((none, wrong, valid) == (401, 401, 200), detail)


def exp_redis_flushed(stack: Stack, plan: Plan) -> Outcome:
    """FLUSHALL under traffic: no valid key gets a 401 (an empty Redis revokes nothing) and both the base
    model and the adapter answer again once the records are re-published."""
    with traffic(stack) as codes:
        time.sleep(2)
        stack.bus.redis.flushall()
        t0 = time.monotonic()
        back = wait_until(lambda: stack.all_answer(), plan.recover_s, 0.5)
        took = time.monotonic() - t0
        time.sleep(2)
    pools = stack.bus.redis.hlen(pools_key(stack.bus.ns))
    n401 = sum(c == 401 for cs in codes.values() for c in cs)
    seen = f"FLUSHALL under traffic: {n401} responses 401; traffic: {summary(codes)}; pool records {pools}"
    if back:
        return Outcome(n401 == 0, f"{seen}; base and adapter answer again after {took:.1f} s")
    return Outcome(False, f"{seen}; not both answering within {plan.recover_s:.0f} s")


def exp_redis_down(stack: Stack, plan: Plan) -> Outcome:
    """Redis stopped under traffic, and one key's Secret removed from the files meanwhile (unseen: the
    key map cannot be re-published). Within the auth-stale bound (30 s) the valid key is served from the
    gateway's last view; past it the removed key gets 503 with Retry-After (fail closed, never 200 nor a
    401 for a key that may be valid); Redis restarted empty, the removed key is a 401 and the valid key,
    the base model and the adapter answer again."""
    doomed = stack.folder / "secret-chaos-doomed.yaml"
    kept = doomed.read_text()
    try:
        with traffic(stack) as codes:
            time.sleep(1)
            stack.redis.stop()
            t_down = time.monotonic()
            doomed.unlink()
            time.sleep(min(plan.redis_down_s, 8.0))
            early = {m: list(cs) for m, cs in codes.items()}
        # The bound is the gateway's --auth-stale (30 s): the first 503 of the removed key, at most 60 s.
        refused = wait_until(lambda: (c := _code(stack, DOOMED_KEY))[0] == 503 and c, 60, 1.0)
        refused_after = time.monotonic() - t_down
        valid_late = _code(stack, KEY)[0]
        time.sleep(max(0.0, plan.redis_down_s - (time.monotonic() - t_down)))
        down_for = time.monotonic() - t_down
        stack.redis.start()
        t0 = time.monotonic()
        back = wait_until(lambda: stack.all_answer(), plan.recover_s, 0.5)
        took = time.monotonic() - t0
        revoked = wait_until(lambda: _code(stack, DOOMED_KEY)[0] == 401, plan.recover_s, 0.5)
    finally:
        doomed.write_text(kept)  # the next experiments' stack as it was
    alive = stack.serve_alive()
    n200 = sum(c == 200 for cs in early.values() for c in cs)
    n = sum(len(cs) for cs in early.values())
    detail = (
        f"Redis down {down_for:.0f} s, the doomed key's Secret removed meanwhile; first {min(plan.redis_down_s, 8.0):.0f} s: "  # noqa: E501
        f"{summary(early)}; removed key "
        + (
            f"refused {refused[0]} (Retry-After {refused[1]!r}) after {refused_after:.0f} s"
            if refused
            else "NEVER refused with 503 within 60 s"
        )
        + f", valid key then {valid_late}; restarted empty: "
        + (f"base and adapter answer after {took:.1f} s" if back else "NOT answering")
        + f", removed key {'401' if revoked else 'NOT 401'}; serve {'alive' if alive else 'EXITED'}"
    )
    held = bool(refused) and refused[1] != "" and n200 == n and bool(back) and bool(revoked) and alive
    return Outcome(held, detail)


def exp_result_suppressed(stack: Stack, plan: Plan) -> Outcome:
    """The worker's result event refused by Redis (ACL: no XADD for the default user) until the worker has
    retried it a few seconds, then allowed again: the job ends Succeeded with exactly one result event."""

    def running() -> bool:
        return stack.job_condition("Running") == "True"

    def ended() -> bool:
        return "True" in (stack.job_condition("Succeeded"), stack.job_condition("Failed"))

    if not wait_until(lambda: running() or ended(), 180):
        return Outcome(False, f"the TuningJob never ran: status {stack.job_status()}")
    if ended():
        return Outcome(False, "the TuningJob ended before the fault could be injected (make it longer)")
    r = stack.bus.redis
    r.execute_command("ACL", "SETUSER", "default", "-xadd")
    t0 = time.monotonic()
    try:
        pat = re.compile(rf"cannot post (succeeded|failed) event of \S*{JOB}\S* .*retrying")
        seen = wait_until(lambda: any(pat.search(t) for t in stack.worker_logs().values()), 120, 0.5)
        if seen:
            time.sleep(5)
    finally:
        r.execute_command("ACL", "SETUSER", "default", "+xadd")
    refused = time.monotonic() - t0
    if not seen:
        return Outcome(False, f"events refused {refused:.0f} s but the worker never tried to post a result")
    finished = wait_until(ended, 90)
    st = stack.job_status()
    results = [e for _, e in stack.bus.events(_job_key(stack)) if e.type in ("succeeded", "failed")]
    detail = (f"XADD refused {refused:.0f} s (the worker logged its result retries); job "
              f"Succeeded={stack.job_condition('Succeeded') or '-'}, attempts {st.get('attempts')}, "
              f"result events in the stream: {len(results)}")  # fmt: skip
    held = bool(finished) and stack.job_condition("Succeeded") == "True" and len(results) == 1
    return Outcome(held, detail)


def _job_key(stack: Stack) -> str:
    prefix, suffix = events_key(stack.bus.ns, "").split("::")
    keys = [
        str(k)[len(prefix) + 1 : -len(suffix) - 1] for k in stack.bus.redis.scan_iter(f"{prefix}:*:{suffix}")
    ]
    return next((k for k in keys if JOB in k), f"default/{JOB}")


def exp_poison(stack: Stack, plan: Plan) -> Outcome:
    """A malformed worker record, pool record and event in the registry: each skipped and logged by the
    gateway and the control plane (the gateway counts them in elastune_gateway_poison_records_total; with
    API keys its /metrics is only on a --metrics-port, which `elastune serve` does not open, so the bench
    reads its log), nothing stops serving."""
    r = stack.bus.redis
    ns = stack.bus.ns
    bad_worker = worker_key(ns, "poison-w")
    r.set(bad_worker, b"\xff\xfe{not json", ex=60)
    r.sadd(f"{ns}:workers", "poison-w")  # the registry's index of worker ids
    r.hset(pools_key(ns), "poison-pool", '{"pool": 1}')
    r.xadd(events_key(ns, "default/poison-job"), {"event": b"\xff not an event"})
    gateway_log = stack.state / "logs" / "gateway.log"
    before = len(gateway_log.read_text(errors="replace")) if gateway_log.exists() else 0

    def skipped(text: str) -> set[str]:
        return set(re.findall(r"skipping a malformed (\w+) entry at \S*poison", text))

    def gateway_skipped() -> set[str]:
        return skipped(gateway_log.read_text(errors="replace")[before:])

    wait_until(lambda: gateway_skipped() >= {"worker", "pool"}, 15, 0.5)
    gw = gateway_skipped()
    wait_until(lambda: skipped(stack.serve_log_text()), 10, 0.5)
    ctl = skipped(stack.serve_log_text())
    ready = stack.http.get(stack.url + "/readyz").status_code
    ok = stack.all_answer()
    r.delete(bad_worker)
    r.srem(f"{ns}:workers", "poison-w")
    r.hdel(pools_key(ns), "poison-pool")
    alive = stack.serve_alive()
    detail = (f"malformed worker record, pool record and event written: gateway /readyz {ready}, base and "
              f"adapter {'answer' if ok else 'DO NOT answer'}; the gateway skipped and logged "
              f"{sorted(gw) or 'NONE'}, the control plane {sorted(ctl) or 'NONE'}; serve "
              f"{'alive' if alive else 'EXITED'}")  # fmt: skip
    return Outcome(ok and alive and ready == 200 and {"worker", "pool"} <= gw and bool(ctl), detail)
