"""One HTTP request's call into the engine deployment, shared by every API family: admitted
through the ingress's gate, sent as one streaming handle call carrying all its sub-requests,
read batch by batch, and cancelled whatever happened. Failures become `APIError`s: overload
503/429 with `Retry-After`, a lost replica 503, a deadline 504.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from model.engine.sequence import RequestOutput
from service.admission import AdmissionGate
from service.engine_loop import EngineFailure, SubRequest
from service.errors import APIError, overloaded_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OverloadPolicy:
    """How a request turned away by the bounded queue is answered."""

    status: int = 503
    retry_after_s: float = 1.0
    capacity: int = -1  # requests admitted at once by this ingress replica (service/admission.py)


class EngineCall:
    """The engine call of one HTTP request: started, read batch by batch, cancelled."""

    def __init__(self, handle: Any, requests: list[SubRequest], overload: OverloadPolicy, gate: AdmissionGate,
                 timeout_s: float | None = None) -> None:
        self._handle, self._requests, self._overload, self._gate = handle, requests, overload, gate
        self._admitted = False
        self._timeout_s = timeout_s
        # Event-loop time by which the whole request must be done (queueing included).
        self._deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self._gen: Any = None
        self._first: list[RequestOutput] | None = None
        self.done = False

    async def start(self) -> None:
        """Send the call and wait for its first item, so a rejection (overload, bad input)
        is still a plain HTTP error rather than a broken stream. Past the admission capacity
        it is turned away at once; `cancel()`, which every path ends with, frees its slot."""
        self._gate.acquire()
        self._admitted = True
        self._gen = self._handle.generate.remote(self._requests)
        self._first = self._check(await self._next_item())

    async def _next(self) -> Any:
        try:
            if self._deadline is None:
                return await self._gen.__anext__()
            remaining = max(self._deadline - asyncio.get_running_loop().time(), 0.0)
            return await asyncio.wait_for(self._gen.__anext__(), remaining)
        except TimeoutError:  # still running in the engine: `cancel()` aborts it and frees its blocks
            raise APIError(f"The request did not finish within the server's limit of {self._timeout_s:g} s "
                           "and was aborted.", 504, "timeout_error", code="request_timeout") from None
        except Exception:  # failed or finished (not cancelled): nothing left to cancel
            self.done = True
            raise

    async def _next_item(self) -> Any:
        try:
            return await self._next()
        except BackPressureError:
            raise overloaded_error(self._overload.status, self._overload.retry_after_s) from None
        except DeploymentUnavailableError:
            raise APIError("The engine deployment is unavailable; retry later.", 503, "server_error",
                           headers={"Retry-After": "5"}) from None
        except RayActorError as exc:  # the replica died (killed, node lost): Serve starts another
            logger.warning("engine replica lost: %s", type(exc).__name__)
            raise APIError("The engine replica serving this request died; retry it.", 503, "server_error",
                           code="replica_failed", headers={"Retry-After": "5"}) from None
        except RayTaskError as exc:
            logger.warning("engine call failed: %s", type(exc).__name__)
            raise APIError("The engine replica failed while serving this request.", 500, "server_error") from None

    def _check(self, item: Any) -> list[RequestOutput]:
        if isinstance(item, EngineFailure):
            self.done = True
            kind = "invalid_request_error" if item.status == 400 else "server_error"
            raise APIError(item.message, item.status, kind)
        return item

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Every batch of deltas, the first one included; raises `APIError` on failure."""
        first, self._first = self._first, None
        if first is not None:
            yield first
        while True:
            try:
                item = await self._next_item()
            except StopAsyncIteration:
                return
            yield self._check(item)

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self._gate.release()

    def __del__(self) -> None:  # a response dropped before its body was read: free the slot anyway
        self._release()

    def cancel(self) -> None:
        """Abort what is still running (client gone, or an error on our side); called once the
        request is over, whatever happened."""
        self._release()
        if self._gen is not None and not self.done:
            self.done = True
            try:
                self._gen.cancel()
            except Exception as exc:  # already failed or finished on Serve's side
                logger.debug("cancel: %s", type(exc).__name__)
