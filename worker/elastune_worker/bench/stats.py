"""What every benchmark reports alike: nearest-rank percentiles and the machine's load."""

from __future__ import annotations

import os


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def loadavg() -> list[float]:
    """1, 5 and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]
