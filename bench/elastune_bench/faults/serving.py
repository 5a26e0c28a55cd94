"""Experiments on what is asked of the serving path: bad inputs, adapters that cannot be served, a pool that
cannot start. Each must end in a clear, OpenAI-shaped error for that request alone, never a 200 with a
wrong answer, never a hold, never a 500 (issue 38 items 3 and 4)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .stack import (
    ADAPTER,
    BROKEN_MODEL,
    CORRUPT,
    MODEL,
    OVERFLOWING,
    Outcome,
    Plan,
    Stack,
    lists,
    stream,
    summary,
    traffic,
    wait_until,
)

SURROGATE_BODY = b'{"model": "%s", "prompt": "12 km \\ud800 ->", "max_tokens": 2}'


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:120]


def _openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
        return isinstance(err, dict) and bool(err.get("message")) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False


def _worker(stack: Stack) -> str:
    return sorted(r.url for r in stack.serving_workers().values())[0]


def exp_unknown_model(stack: Stack, plan: Plan) -> Outcome:
    """A model nothing serves: refused at once, OpenAI-shaped; a 404, or a 403 where the key's scope is
    checked first (the gateway does not tell a key which models exist outside its scope)."""
    t0 = time.monotonic()
    r = stack.complete("no-such-model-or-adapter")
    took = time.monotonic() - t0
    detail = (
        f"a request for a model nothing serves: {r.status_code} after {took:.1f} s ({_message(r)[:90]!r})"
    )
    return Outcome(r.status_code in (403, 404) and _openai_error(r) and took < 5, detail)


def exp_malformed_body(stack: Stack, plan: Plan) -> Outcome:
    """Bodies a client gets wrong: not JSON, JSON of the wrong shape, a negative max_tokens."""
    url = stack.url + "/v1/completions"
    cases = {
        "not JSON": stack.http.post(url, content=b"{not json", headers={"content-type": "application/json"}),
        "a list": stack.http.post(url, json=[1, 2]),
        "max_tokens -1": stack.http.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": -1}),
        "no prompt": stack.http.post(url, json={"model": MODEL, "max_tokens": 2}),
    }
    codes = {k: r.status_code for k, r in cases.items()}
    shaped = all(_openai_error(r) for r in cases.values())
    detail = f"{codes}, every one an OpenAI-shaped error: {shaped}"
    return Outcome(all(c == 400 for c in codes.values()) and shaped and stack.answers(MODEL), detail)


def exp_oversized_body(stack: Stack, plan: Plan) -> Outcome:
    """A 5 MiB body (the gateway's limit is 4 MiB) and a prompt over the prompt-length limit."""
    url = stack.url + "/v1/completions"
    huge = stack.http.post(url, json={"model": MODEL, "prompt": "x" * (5 << 20), "max_tokens": 2})
    long = stack.http.post(url, json={"model": MODEL, "prompt": "x " * 600_000, "max_tokens": 2})
    detail = (f"5 MiB body: {huge.status_code} ({_message(huge)[:60]!r}); a 1.2 M-character prompt: "
              f"{long.status_code} ({_message(long)[:60]!r})")  # fmt: skip
    return Outcome(
        huge.status_code == 413 and long.status_code in (400, 413) and stack.answers(MODEL), detail
    )


def exp_surrogate_gateway(stack: Stack, plan: Plan) -> Outcome:
    """A lone surrogate (``\\ud800``) in a prompt sent to the gateway: a 400, OpenAI-shaped."""
    r = stack.http.post(stack.url + "/v1/completions", content=SURROGATE_BODY % MODEL.encode(),
                        headers={"content-type": "application/json"})  # fmt: skip
    detail = (
        f"a lone surrogate (\\ud800) in the prompt, at the gateway: {r.status_code} ({_message(r)[:90]!r})"
    )
    return Outcome(r.status_code == 400 and _openai_error(r), detail)


def exp_surrogate_worker(stack: Stack, plan: Plan) -> Outcome:
    """The same prompt sent straight to a worker (with the gateway's credential): a 400 as at the
    gateway (before: 500 TypeError)."""
    url = _worker(stack)
    headers = {"content-type": "application/json", **stack.worker_headers()}
    r = stack.http.post(url + "/v1/completions", content=SURROGATE_BODY % MODEL.encode(), headers=headers)
    detail = (f"a lone surrogate (\\ud800) in the prompt, straight to worker {url}: {r.status_code} "
              f"({_message(r)[:90]!r})")  # fmt: skip
    return Outcome(r.status_code == 400 and _openai_error(r), detail)


def _load(stack: Stack, url: str, name: str, path: str) -> httpx.Response:
    return stack.http.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                           headers={"Authorization": f"Bearer {stack.control_token()}"})  # fmt: skip


def exp_corrupt_direct_load(stack: Stack, plan: Plan) -> Outcome:
    """A safetensors file that is not one, loaded straight on a worker (its control API): a 400 naming
    the file, and the worker serves on."""
    url = _worker(stack)
    r = _load(stack, url, "chaos-corrupt", str(stack.broken[CORRUPT]))
    detail = f"corrupt adapter_model.safetensors loaded on {url}: {r.status_code} ({_message(r)[:100]!r})"
    named = "safetensors" in _message(r)
    return Outcome(r.status_code == 400 and named and stack.answers(MODEL), detail)


def exp_adapter_overflow(stack: Stack, plan: Plan) -> Outcome:
    """An adapter whose finite weights overflow: refused at load by the worker's probe (a direct load is
    a 400 naming it) and, as a LoRAAdapter, a greedy request for it never gets a 200 (empty text) but an
    OpenAI-shaped error at once."""
    url = _worker(stack)
    direct = _load(stack, url, "chaos-overflow", str(stack.broken[OVERFLOWING]))
    refused = wait_until(lambda: _unservable(stack, OVERFLOWING), plan.recover_s, 0.5)
    t0 = time.monotonic()
    r = stack.complete(OVERFLOWING, temperature=0)
    took = time.monotonic() - t0
    detail = (f"direct load: {direct.status_code} ({_message(direct)[:70]!r}); LoRAAdapter status: "
              f"{refused or 'no failure condition'}; a greedy request for it: {r.status_code} after "
              f"{took:.1f} s ({_message(r)[:90]!r})")  # fmt: skip
    held = direct.status_code == 400 and "finite" in _message(direct) and r.status_code != 200
    return Outcome(held and _openai_error(r) and took < 5, detail)


def _unservable(stack: Stack, name: str) -> str:
    """``Type=Status (Reason)`` of the adapter's failed condition, '' while it has none."""
    for c in stack.adapter_status(name).get("conditions", []):
        if c.get("status") == "False" and c.get("reason") and "Load" in c.get("reason", ""):
            return f"{c['type']}=False ({c['reason']})"
    return ""


def exp_adapter_load_failed(stack: Stack, plan: Plan) -> Outcome:
    """A LoRAAdapter whose file cannot be read (AdapterLoadFailed): a request for it is answered at once
    with a 4xx/503 naming the reason, not held for the pool's hold timeout (60 s)."""
    cond = wait_until(lambda: _unservable(stack, CORRUPT), plan.recover_s, 0.5)
    t0 = time.monotonic()
    r = stack.complete(CORRUPT)
    took = time.monotonic() - t0
    msg = _message(r)
    detail = (f"LoRAAdapter status {cond or 'without a failure condition'}; a request for it: "
              f"{r.status_code} after {took:.1f} s ({msg[:110]!r})")  # fmt: skip
    held = r.status_code in (400, 404, 409, 422, 503) and "AdapterLoadFailed" in msg and took < 5
    return Outcome(held and bool(cond), detail)


def exp_bad_request(stack: Stack, plan: Plan) -> Outcome:
    """8 streams; while they run, one request with seed 2**64 (must be refused with a 400 naming it) and
    one whose sampling raises inside the engine step (the workers' ``sampler-raise`` failpoint: seed
    FAILPOINT_SEED): only that request fails, the 8 complete."""
    from elastune_worker.engine.model_runner.sampler import FAILPOINT_SEED

    def one(i: int, seed: int) -> tuple[int, int, str, float]:
        body = {"model": ADAPTER if i % 2 else MODEL, "prompt": f"{i} km ->", "max_tokens": 192,
                "temperature": 0.8, "seed": seed}  # fmt: skip
        s = stream(stack.url, body)
        return s.code, s.chunks, s.finish, s.ended

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(one, i, i) for i in range(8)]
        time.sleep(0.2)
        poisoned = pool.submit(one, 8, FAILPOINT_SEED)
        bad = stack.complete(MODEL, seed=18446744073709551616, temperature=0.8)
        t_bad = time.monotonic()
        results = [f.result() for f in futures]
        p_code, p_chunks, p_end, _ = poisoned.result()
    complete = sum(code == 200 and finish in ("length", "stop") for code, _, finish, _ in results)
    running = sum(t_end > t_bad for *_, t_end in results)
    failed_alone = p_code != 200 or p_end.startswith("error")
    detail = (f"seed 2**64 answered {bad.status_code} ({bad.text[:70]!r}) while {running}/8 streams ran; "
              f"a request failing inside the sampling step: {p_code} after {p_chunks} chunks ({p_end!r}); "
              f"{complete}/8 streams completed")  # fmt: skip
    return Outcome(bad.status_code == 400 and complete == 8 and failed_alone, detail)


def exp_unload(stack: Stack, plan: Plan) -> Outcome:
    """The adapter unloaded behind the control plane's back (the worker's control API): refused without
    the control token; with it, unloaded (gone from the worker's /v1/models), then loaded there again by
    the placement sync and served."""
    holders = [r for r in stack.serving_workers().values() if lists(stack, r.url, ADAPTER)]
    if not holders:
        return Outcome(False, f"no worker lists {ADAPTER} (workers: {sorted(stack.serving_workers())})")
    w = holders[0]
    body = {"lora_name": ADAPTER}
    anon = stack.http.post(w.url + "/v1/unload_lora_adapter", json=body, headers={"Authorization": ""})
    ctl = {"Authorization": f"Bearer {stack.control_token()}"}
    unloaded = stack.http.post(w.url + "/v1/unload_lora_adapter", json=body, headers=ctl)
    gone = not lists(stack, w.url, ADAPTER)
    t0 = time.monotonic()
    back_on_worker = wait_until(lambda: lists(stack, w.url, ADAPTER), plan.recover_s, 0.5)
    took = time.monotonic() - t0
    try:
        served = str(stack.complete(ADAPTER, max_tokens=2).status_code)
    except httpx.HTTPError as exc:
        served = f"no answer ({type(exc).__name__})"
    detail = (f"unauthenticated unload on {w.id}: {anon.status_code}; with the control token: "
              f"{unloaded.status_code} (gone from its /v1/models: {gone}); "
              + (f"loaded there again after {took:.1f} s" if back_on_worker
                 else f"NOT loaded there again within {plan.recover_s:.0f} s")
              + f"; a request for it through the gateway: {served}")  # fmt: skip
    if unloaded.status_code != 200:
        detail += f" (the unload's answer: {_message(unloaded)[:80]!r}: nothing was unloaded)"
    held = anon.status_code == 401 and unloaded.status_code == 200 and gone and bool(back_on_worker)
    return Outcome(held and served == "200", detail)


def exp_crash_loop(stack: Stack, plan: Plan) -> Outcome:
    """Demand for a pool whose workers cannot start (unknown model): they exit at once, again and again.
    Held when the request for it is answered with an error in bounded time and the healthy pool keeps
    answering while the broken one loops."""
    window = 21.0 if plan.quick else 60.0  # past the broken pool's 20 s hold timeout either way
    logs = stack.state / "logs"
    before = {p.name for p in logs.glob("broken-*.log")}
    t0 = time.monotonic()
    with traffic(stack) as codes:
        try:
            r = stack.complete(BROKEN_MODEL)
            code, text = r.status_code, r.text[:100]
        except httpx.HTTPError as exc:
            code, text = 0, str(exc)
        waited = time.monotonic() - t0
        time.sleep(max(0.0, window - waited))
    elapsed = time.monotonic() - t0
    starts = len({p.name for p in logs.glob("broken-*.log")} - before)
    alive = stack.serve_alive()
    healthy = all(cs and sum(c == 200 for c in cs) == len(cs) for cs in codes.values())
    detail = (f"request for the broken pool: {code} after {waited:.1f} s ({text!r}); {starts} worker "
              f"processes started for it in {elapsed:.0f} s; healthy pool meanwhile: {summary(codes)}; serve "
              f"{'alive' if alive else 'EXITED'}")  # fmt: skip
    return Outcome(code in (503, 504) and healthy and alive, detail)
