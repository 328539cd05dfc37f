"""The streaming path's last mile (service/http/event_stream.py, service/openai/formats.py): an
event stream's body skips the middleware stack but its start does not, a client that leaves
closes the event iterator, and the chunk lines with their head encoded once are the same text
as `sse(chunk)`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI

from service.http.event_stream import EventStream
from service.openai.formats import ChunkLines, sse
from service.server.api import ResponseCounter


class Seen:
    """A middleware that records the type of every message sent through it."""

    def __init__(self, app: Any, log: list[str]) -> None:
        self.app, self.log = app, log

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def seen(message: dict[str, Any]) -> None:
            self.log.append(message["type"])
            await send(message)

        await self.app(scope, receive, seen)


def app_over(events: AsyncIterator[str], log: list[str]) -> Any:
    app = FastAPI()

    @app.get("/s")
    async def stream() -> EventStream:
        return EventStream(events)

    app.add_middleware(Seen, log=log)  # inside the counter, like Starlette's own wrappers
    app.add_middleware(ResponseCounter, record=None)
    return app


async def call(app: Any, leave_after: int | None = None) -> list[dict[str, Any]]:
    """The messages the server got; the client leaves after `leave_after` body messages."""
    sent: list[dict[str, Any]] = []
    left = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if leave_after is None:
            await asyncio.Event().wait()  # the client never leaves
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if leave_after is not None and sum(m["type"] == "http.response.body" for m in sent) >= leave_after:
            left.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/s", "raw_path": b"/s", "query_string": b"", "root_path": "", "headers": [],
             "client": ("t", 1), "server": ("t", 2)}
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


def test_the_body_skips_the_stack_and_the_start_does_not() -> None:
    async def events() -> AsyncIterator[str]:
        for i in range(3):
            yield f"data: {i}\n\n"
        yield ""  # nothing to write: no message

    log: list[str] = []
    sent = asyncio.run(call(app_over(events(), log)))
    assert log == ["http.response.start"]
    assert sent[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert [m.get("more_body") for m in sent[1:]] == [True, True, True, False]


def test_a_client_that_leaves_closes_the_events() -> None:
    closed: list[bool] = []

    async def endless() -> AsyncIterator[str]:
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0.01)
        finally:  # what the serving code's `finally: run.cancel()` relies on
            closed.append(True)

    sent = asyncio.run(call(app_over(endless(), []), leave_after=2))
    assert closed == [True]
    assert 2 <= sum(m["type"] == "http.response.body" for m in sent) <= 3


def test_an_error_in_the_events_is_raised() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "data: 0\n\n"
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(call(app_over(failing(), [])))


@pytest.mark.parametrize("chunk", [
    {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
     "choices": [{"index": 0, "text": "héllo \"q\"\n", "logprobs": None, "finish_reason": None}]},
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
     "choices": [{"index": 1, "delta": {"content": "✓"}, "logprobs": {"content": []}, "finish_reason": "stop"}]},
    {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",  # two choices
     "choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]},
    {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", "choices": [],  # the usage chunk
     "usage": {"prompt_tokens": 1}},
    {"id": "cmpl-2", "object": "text_completion", "created": 7, "model": "m", "choices": [{"index": 0}]},  # another id
])
def test_chunk_lines_are_the_sse_of_the_chunk(chunk: dict[str, Any]) -> None:
    line = ChunkLines(chunk["id"] if chunk["id"] != "cmpl-2" else "cmpl-1", chunk["object"], 7, "m").line(chunk)
    assert line == sse(chunk)
    assert json.loads(line[len("data: "):]) == chunk
