"""One HTTP request carried over a Ray Serve streaming handle to an ASGI app in another process,
and its response carried back: how the multi-model front (service/app/multi.py) reaches each
model's engine replicas, whose own HTTP edge (service/server/api.py) then answers exactly as it does
when HAProxy sends it the request directly.

The front sends a `ForwardedRequest` (method, path, headers, the whole body); the replica runs its
ASGI app over it (`run_asgi`) and streams back the response start `(status, headers)` and then
the body's chunks. Chunks the app wrote while the last one was in transit travel as one message,
so a front that lags gets merged SSE events rather than a queue of small messages. Cancelling
the stream (the client went away) disconnects the app, which aborts the engine's sequences.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# Headers that describe the front's own connection, not the request.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer"})


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the front received it, its body read whole."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        headers = [(k, v) for k, v in self.headers if k.lower() not in _HOP_BY_HOP and k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(self.body)).encode()))
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "root_path": "", "query_string": self.query_string, "headers": headers, "client": self.client,
                "server": ("127.0.0.1", 0)}


@dataclass(frozen=True)
class ResponseStart:
    """The first item of a forwarded response."""

    status: int
    headers: list[tuple[bytes, bytes]]


async def run_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `app` over `request`: yields the `ResponseStart`, then the body in chunks (those the app
    wrote since the last yield joined into one). Closing the iterator early disconnects the app."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        queue.put_nowait(message)

    task = asyncio.create_task(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        done = False  # the last body chunk was sent, or the app returned
        while not done:
            message = await queue.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
                continue
            chunks = [message.get("body", b"")]
            done = not message.get("more_body", False)
            while not done and not queue.empty():  # what else is ready travels with it
                nxt = queue.get_nowait()
                done = nxt is None or not nxt.get("more_body", False)
                chunks.append(b"" if nxt is None else nxt.get("body", b""))
            body = b"".join(chunks)
            if body:
                yield body
        await task  # the app's own exception, if it raised one
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
