"""What every benchmark reports alike: nearest-rank percentiles and the machine's load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def loadavg() -> list[float]:
    """1, 5 and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def finish(result: dict[str, Any], json_path: Path | None) -> None:
    """The closing lines every benchmark prints: the machine and its load around the run, then the JSON
    written to ``json_path`` (when given)."""
    m = result["machine"]
    print(f"  machine: {m['nproc']} cores, load {m['loadavg_before']} -> {m['loadavg_after']}", flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
