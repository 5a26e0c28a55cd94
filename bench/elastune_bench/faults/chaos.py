"""`elastune bench chaos`: faults injected into real processes on this machine, each scored held or lost.

The experiments (registry.py) keep the 22 fault and bad-input cases of issue 38. Most run one after
the other on one local stack as a user runs it (stack.py): a redis-server the bench owns, `elastune
serve` with local CPU workers and the gateway, API keys, HTTP traffic. An experiment that kills a part
waits until the stack serves again; one that ends lost, or leaves it not serving, gets a fresh stack for
the next, so each is judged on its own. The local-supervision experiments run on a second, small serve
with its embedded Redis; `elastune run` and the operator (against the Kubernetes API emulator of the
development extras) run on their own.

Prints a table (experiment | held/lost | what was seen); ``--json PATH`` writes
``{experiment: {"held": bool, "detail": str, "seconds": float, "cases": [...]}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .registry import BY_NAME, CASES, EXPERIMENTS, Experiment
from .stack import Outcome, Plan, Stack, start_stack

__all__ = ["Outcome", "main", "run", "table"]


def _record(exp: Experiment, target: Any, plan: Plan, results: dict[str, Outcome], out: Any) -> Outcome:
    print(f"[chaos] {exp.name} ...", file=out, flush=True)
    t0 = time.monotonic()
    try:
        res = exp.run(target, plan)
    except Exception as exc:
        res = Outcome(False, f"the experiment raised {type(exc).__name__}: {exc}")
    res.seconds = time.monotonic() - t0
    results[exp.name] = res
    print(f"[chaos] {exp.name}: {'held' if res.held else 'LOST'} ({res.seconds:.0f} s) {res.detail}",
          file=out, flush=True)  # fmt: skip
    return res


def _run_stack(todo: list[Experiment], plan: Plan, root: Path, results: dict[str, Outcome], out: Any) -> None:
    stack: Stack | None = None
    n = 0
    try:
        for exp in todo:
            if stack is None:
                n += 1
                long_job = n == 1 and exp.name == "result-suppressed"
                # The TuningJob runs while the stack starts: its experiment starts with the stack.
                stack = start_stack(root / f"stack-{n}", plan.job_iterations if long_job else 5, out,
                                    wait=not long_job, light=plan.light)  # fmt: skip
            res = _record(exp, stack, plan, results, out)
            if not stack.serve_alive():
                last = [ln for ln in stack.serve_log_text().splitlines() if ln.strip()][-1:]
                res.held = False
                res.detail += (
                    f"; `elastune serve` EXITED (code {stack.serve.returncode}: {(last or [''])[0][:160]})"
                )
            # A stack that does not serve after an experiment that broke something (or lost): the next
            # experiment gets a fresh stack, so each is judged on its own.
            if (exp.breaks or not res.held) and stack.wait_serving(plan.recover_s * 2) is None:
                print(f"[chaos] a fresh stack after {exp.name}", file=out, flush=True)
                stack.close()
                stack = None
    finally:
        if stack is not None:
            stack.close()


def _run_local(todo: list[Experiment], plan: Plan, root: Path, results: dict[str, Outcome], out: Any) -> None:
    from .local import LocalServe, start_local

    serve: LocalServe | None = None
    n = 0
    try:
        for exp in todo:
            if serve is None or serve.proc.poll() is not None:
                n += 1
                serve = start_local(root / f"local-{n}")
            _record(exp, serve, plan, results, out)
    finally:
        if serve is not None:
            serve.close()


def run(plan: Plan, root: Path, only: set[str] | None = None, out: Any = sys.stdout) -> dict[str, Outcome]:
    """Run the experiments (``only``: these, in registry order) and return their outcomes."""
    todo = [e for e in EXPERIMENTS if only is None or e.name in only]
    results: dict[str, Outcome] = {}

    errors: list[str] = []

    def others() -> None:
        try:
            _run_local([e for e in todo if e.site == "local"], plan, root, results, out)
        except Exception as exc:  # the local serve never started: its experiments are lost, the rest run
            errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        for exp in (e for e in todo if e.site == "alone"):
            _record(exp, root / exp.name, plan, results, out)

    # The local serve, `elastune run` and the operator share nothing with the main stack: they run beside
    # it (most of the stack's time is waiting out a fault's window), one after the other.
    side = threading.Thread(target=others, name="chaos-side", daemon=True)
    side.start()
    try:
        _run_stack([e for e in todo if e.site == "stack"], plan, root, results, out)
    finally:
        side.join()
    why = f"not run: {errors[0]}" if errors else "not run"
    return {e.name: results.get(e.name) or Outcome(False, why) for e in todo}


def table(results: dict[str, Outcome]) -> str:
    rows = [("experiment", "held/lost", "what was seen")]
    rows += [(n, "held" if r.held else "LOST", r.detail) for n, r in results.items()]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"| {a:<{w0}} | {b:<{w1}} | {c} |" for a, b, c in rows]
    lines.insert(1, f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|---|")
    return "\n".join(lines)


def listing() -> str:
    """The registry as two Markdown tables: the cases and the experiments that keep them."""
    lines = ["| case | what | was | held means | experiments |", "|---|---|---|---|---|"]
    for c in CASES:
        names = ", ".join(e.name for e in EXPERIMENTS if c.id in e.cases)
        lines.append(f"| {c.id} | {c.what} | {c.was} | {c.held_means} | {names} |")
    lines += ["", "| experiment | runs on | cases | what it does |", "|---|---|---|---|"]
    for e in EXPERIMENTS:
        doc = " ".join((e.run.__doc__ or "").split())
        lines.append(f"| {e.name} | {e.site} | {', '.join(e.cases)} | {doc} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="elastune bench chaos", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="shorter windows (Redis down 32 s, a worker paused 12 s), shorter jobs")  # fmt: skip
    ap.add_argument("--json", metavar="PATH", help="write {experiment: {held, detail, seconds, cases}} here")
    ap.add_argument("--only", action="append", metavar="NAME[,NAME]",
                    help="run only these experiments (comma-separated, repeatable)")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="print the cases and the experiments, run nothing")
    ap.add_argument("--light", action="store_true",
                    help="a lighter main stack: one warm worker, no TuningJob, no broken pool or adapters "
                         "(enough for the cheap serving experiments; the others then fail)")  # fmt: skip
    ap.add_argument("--keep", metavar="DIR", help="keep state and logs in DIR (default: a temporary folder)")
    args = ap.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    only = {n.strip() for arg in args.only or [] for n in arg.split(",") if n.strip()} or None
    unknown = sorted((only or set()) - set(BY_NAME))
    if unknown:
        ap.error(f"no such experiment: {', '.join(unknown)} (--list names them)")
    plan = Plan(quick=args.quick, recover_s=30.0 if args.quick else 90.0,
                redis_down_s=32.0 if args.quick else 45.0, pause_s=12.0 if args.quick else 20.0,
                job_iterations=60 if args.quick else 300, light=args.light)  # fmt: skip
    t0 = time.monotonic()
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
        results = run(plan, root, only)
    else:
        with tempfile.TemporaryDirectory(prefix="elastune-chaos-") as tmp:
            results = run(plan, Path(tmp), only)
    wall = time.monotonic() - t0
    print()
    print(table(results))
    held = sum(r.held for r in results.values())
    print(f"\n{held}/{len(results)} held in {wall:.0f} s" + (" (quick)" if args.quick else ""))
    if args.json:
        doc = {n: {"held": r.held, "detail": r.detail, "seconds": round(r.seconds, 1),
                   "cases": list(BY_NAME[n].cases)} for n, r in results.items()}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if held == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
