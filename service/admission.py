"""The ingress's own bound on the requests it has admitted to the engine deployment.

Ray Serve's `max_queued_requests` is checked once, when a handle call starts, against the
calls waiting in that caller's router. A call that the router has sent to a replica is not
counted while it waits for the replica's answer, and when the replica turns it away (its
`max_ongoing_requests` slots are full; the router's view of them is a cache) it goes back to
the queue without the check (ray/serve/_private/router.py: `_route_and_send_request_once`
leaves `wrap_queued_request` before `get_rejection_response`; only `assign_request` checks the
limit). Under a burst, more than `max_ongoing_requests` x replicas + `max_queued_requests`
calls are therefore admitted (6 of 10 with a capacity of 4 in one run).

This gate counts every call of one ingress replica from admission to its end and turns away
(503/429 with Retry-After, at once) any call past the capacity, so that bound holds exactly.
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
    """Requests one ingress replica admits at once: every engine slot plus the queue (-1 when
    the queue is unbounded)."""
    if max_queued_requests == -1:
        return -1
    return max_ongoing_requests * engine_replicas + max_queued_requests
