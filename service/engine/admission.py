"""Each engine replica's own bound on the requests it has admitted.

Every request a replica serves passes its gate, from admission to its end; one past the
capacity (the engine's slots plus the queue, `admission_capacity`) is turned away at once with
503/429 and Retry-After, in the API's error shape. Serve's own limits (`max_ongoing_requests`,
`max_queued_requests`) sit above it: under a burst they let more calls in than they are set to
(ray/serve/_private/router.py: a call the replica turns away goes back to the queue without the
check, 6 of 10 admitted with a capacity of 4 in one run), and a direct-ingress replica answers
their overflow with a bare text body. The gate holds the bound exactly.
"""

from __future__ import annotations

from collections.abc import Callable


class AdmissionGate:
    """At most `capacity` admitted calls at once (-1: no limit); past that `acquire` raises
    `reject()`. Used from one event loop only, so plain counting is safe."""

    def __init__(self, capacity: int, reject: Callable[[], Exception]) -> None:
        if capacity < -1:
            raise ValueError(f"capacity must be -1 (no limit) or >= 0, got {capacity}")
        self.capacity = capacity
        self._reject = reject
        self.admitted = 0

    def acquire(self) -> None:
        """Take a slot, or raise `reject()` when none is free."""
        if self.capacity != -1 and self.admitted >= self.capacity:
            raise self._reject()
        self.admitted += 1

    def release(self) -> None:
        """Give back a slot taken by `acquire` (once per `acquire`)."""
        self.admitted -= 1


def admission_capacity(max_ongoing_requests: int, engine_replicas: int, max_queued_requests: int) -> int:
    """Requests admitted at once across `engine_replicas` replicas: every engine slot plus the queue (-1 when
    the queue is unbounded)."""
    if max_queued_requests == -1:
        return -1
    return max_ongoing_requests * engine_replicas + max_queued_requests
