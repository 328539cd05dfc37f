"""A burst of streaming completions that leave together: the overload and queue-sizing tests'
client."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx


def burst(base_url: str, body: dict[str, Any], total: int) -> list[tuple[float, int, dict[str, Any]]]:
    """`total` streaming requests that leave together, each read to its end; (when it ended,
    status, headers and body) each."""
    events: list[tuple[float, int, dict[str, Any]]] = []
    lock = threading.Lock()
    start = threading.Barrier(total)

    def one(_: int) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as http:
            http.get("/health")  # connect first, so the requests themselves leave together
            start.wait()
            with http.stream("POST", "/v1/completions", json=body) as r:
                payload = r.read()
                info = {"retry_after": r.headers.get("retry-after"), "body": payload}
        with lock:
            events.append((time.monotonic(), r.status_code, info))

    with ThreadPoolExecutor(total) as pool:
        list(pool.map(one, range(total)))
    assert len(events) == total
    return events
