"""Server-sent events written straight to the server's ASGI `send`: the streaming path's last mile.

A stream's status and headers go out through the whole middleware stack (so the response
counter, the error middlewares and the API-key check see them), but its body messages, one per
engine step per stream, skip the stack: `ResponseCounter` (the outermost layer, service/server/api.py)
keeps the `send` it was given in the scope (`RAW_SEND`), and `EventStream` writes each piece of
the body there. Starlette's wrappers only watch for the response start, so nothing is lost; what
is saved is a Python call per layer per token, and Starlette's task group per response.

The client's going away is watched the way Starlette's `StreamingResponse` does it: a task reads
`receive()` until `http.disconnect`, then the writer is cancelled, which closes the event
iterator (its `finally` aborts the engine's sequences and frees their blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

RAW_SEND = "qkv.raw_send"  # scope key: the `send` the outermost middleware of the edge was given

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(Response):
    """A `text/event-stream` response over an async iterator of SSE text (str or bytes): each
    item is one body message."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str | bytes]) -> None:
        self._events = events
        self.status_code = 200
        self.background = None
        self.init_headers(HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(scope.get(RAW_SEND, send)))
        watcher = asyncio.ensure_future(_disconnected(receive))
        client_left = False
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            client_left = watcher.done()
        finally:
            watcher.cancel()
            writer.cancel()  # a no-op when it finished; the client left otherwise
            await asyncio.gather(writer, return_exceptions=True)  # let its `finally` run before we return
        if not client_left and not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()  # not a write to a client that had left

    async def _write(self, send: Send) -> None:
        events = self._events
        try:
            async for event in events:
                if not event:  # nothing to write (a batch that produced no event)
                    continue
                await send({"type": "http.response.body", "body": event if isinstance(event, bytes) else event.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await _close(events)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _close(events: Any) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
