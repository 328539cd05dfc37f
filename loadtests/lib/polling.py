"""Waiting for a condition while measuring how long it took (the fault benchmarks' timings)."""

from __future__ import annotations

import time
from collections.abc import Callable


def first_time(probe: Callable[[], bool], timeout_s: float, every_s: float = 0.25) -> float | None:
    """Seconds until `probe()` is true (polled every `every_s`), or None past `timeout_s`."""
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if probe():
            return time.time() - t0
        time.sleep(every_s)
    return None
