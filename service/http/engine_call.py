"""One HTTP request's call into the engine, shared by every API family: admitted through the
replica's gate, started as one stream carrying all its sub-requests, read batch by batch, and
cancelled whatever happened. Failures become `APIError`s: overload 503/429 with `Retry-After`,
a failed engine 503, a deadline 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from model.engine.sequence import RequestOutput
from service.engine.admission import AdmissionGate
from service.engine.engine_loop import EngineFailure, SubRequest
from service.errors import APIError
from service.tenancy.auth import current_tenant
from service.tenancy.keys import Tenant

# Set by the HTTP edge for each request (`service.server.api.respond`): the event is set once the
# request's engine call has its first item, when its status is known (admitted, valid, prefilled).
_first_item: ContextVar[asyncio.Event | None] = ContextVar("qkv_first_item", default=None)


def watch_first_item() -> asyncio.Event:
    """An event set when an engine call made in this context (and the tasks it starts) has its
    first item."""
    event = asyncio.Event()
    _first_item.set(event)
    return event


@dataclass(frozen=True)
class OverloadPolicy:
    """How a request turned away by the admission bound is answered."""

    status: int = 503
    retry_after_s: float = 1.0
    capacity: int = -1  # requests admitted at once by this replica (service/engine/admission.py)


class EngineCall:
    """The engine call of one HTTP request: started, read batch by batch, cancelled.

    `engine.generate(requests)` returns a stream (`service.replica.engine_deployment.EngineStream`):
    `await stream.__anext__()` gives a list of deltas or an `EngineFailure`, `cancel()` aborts."""

    def __init__(self, engine: Any, requests: list[SubRequest], gate: AdmissionGate,
                 timeout_s: float | None = None, quotas: Any = None) -> None:
        """`quotas`: the replica's `service.tenancy.quotas.Quotas`; a request whose key names a
        tenant (`current_tenant`) is admitted by it first, and its tokens are counted there."""
        self._engine, self._requests, self._gate = engine, requests, gate
        self._quotas = quotas
        self._tenant: Tenant | None = current_tenant.get() if quotas is not None else None
        self._lease: str | None = None
        self._admitted = False
        self._timeout_s = timeout_s
        # Event-loop time by which the whole request must be done (queueing included).
        self._deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self._stream: Any = None
        self._first: list[RequestOutput] | None = None
        self.done = False

    async def start(self) -> None:
        """Start the stream and wait for its first item, so a rejection (overload, bad input)
        is still a plain HTTP error rather than a broken stream. Past the admission capacity
        it is turned away at once; `cancel()`, which every path ends with, frees its slot."""
        if self._tenant is not None:
            prompts = {id(r.prompt_token_ids): len(r.prompt_token_ids) for r in self._requests}  # n > 1 shares one
            self._lease = await self._quotas.admit(self._tenant, sum(prompts.values()))
        self._gate.acquire()
        self._admitted = True
        self._stream = self._engine.generate(self._requests)
        self._first = self._check(await self._next())
        if (event := _first_item.get()) is not None:
            event.set()

    async def _next(self) -> Any:
        try:
            if self._deadline is None:
                return await self._stream.__anext__()
            remaining = max(self._deadline - asyncio.get_running_loop().time(), 0.0)
            return await asyncio.wait_for(self._stream.__anext__(), remaining)
        except TimeoutError:  # still running in the engine: `cancel()` aborts it and frees its blocks
            raise APIError(f"The request did not finish within the server's limit of {self._timeout_s:g} s "
                           "and was aborted.", 504, "timeout_error", code="request_timeout") from None
        except StopAsyncIteration:
            self.done = True
            raise

    def _check(self, item: Any) -> list[RequestOutput]:
        if isinstance(item, EngineFailure):
            self.done = True
            kind = "invalid_request_error" if item.status == 400 else "server_error"
            headers = {"Retry-After": "5"} if item.status == 503 else None
            raise APIError(item.message, item.status, kind, headers=headers)
        return item

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Every batch of deltas, the first one included; raises `APIError` on failure."""
        first, self._first = self._first, None
        if first is not None:
            yield self._count(first)
        while True:
            try:
                item = await self._next()
            except StopAsyncIteration:
                return
            yield self._count(self._check(item))

    def _count(self, batch: list[RequestOutput]) -> list[RequestOutput]:
        """A tenant's generated tokens go to its quota as they come."""
        if self._tenant is not None:
            self._quotas.add_tokens(self._tenant, sum(len(out.new_token_ids) for out in batch))
            for out in batch:
                if out.finished:
                    self._quotas.finished(self._tenant, out)
        return batch

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self._gate.release()
        if self._lease is not None:
            lease, self._lease = self._lease, None
            self._quotas.release(lease, self._tenant)

    def __del__(self) -> None:  # a response dropped before its body was read: free the slot anyway
        self._release()
        if self._stream is not None and not self.done:
            self._stream.cancel()

    def cancel(self) -> None:
        """Abort what is still running (client gone, or an error on our side); called once the
        request is over, whatever happened."""
        self._release()
        if self._stream is not None and not self.done:
            self.done = True
            self._stream.cancel()
