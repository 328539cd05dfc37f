"""A non-streamed answer that runs past its first token starts its response early (service/server/api.py
`respond`, `HeldResponse`): a 200, a space every PROBE_EVERY_S, then the body, so that HAProxy,
which passes a client's close on only when a write to it fails, closes the replica's side and the
work is cancelled. Driven here through the real `EngineCall` over a scripted engine stream and a
recorded ASGI send; tests/e2e/test_service_load.py checks it under HAProxy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.responses import JSONResponse

from service.engine.admission import AdmissionGate
from service.errors import APIError
from service.http.engine_call import EngineCall
from service.server import api
from service.server.api import HeldResponse, respond


class ScriptedStream:
    """An engine stream: `first` after `first_after_s`, then nothing until `cancel()`, or until
    `end_after_s` has passed, or until `ends` is set when given (the test says when)."""

    def __init__(self, first: Any, first_after_s: float, end_after_s: float = 0.0,
                 ends: asyncio.Event | None = None) -> None:
        self._items = [(first_after_s, first)]
        self._end_after_s = end_after_s
        self._ends = ends
        self.cancelled = asyncio.Event()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        if self._items:
            delay, item = self._items.pop(0)
            await asyncio.sleep(delay)
            return item
        if self._ends is not None:
            await self._ends.wait()
        else:
            await asyncio.sleep(self._end_after_s)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled.set()


class Engine:
    def __init__(self, stream: ScriptedStream) -> None:
        self.stream = stream

    def generate(self, _requests: list[Any]) -> ScriptedStream:
        return self.stream


def work(stream: ScriptedStream, answer: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
    """A route's work as the API families do it: start, read every batch, cancel in any case."""
    async def run() -> dict[str, Any]:
        call = EngineCall(Engine(stream), [], AdmissionGate(-1, lambda: APIError("full", 503)), timeout_s)
        try:
            await call.start()
            async for _ in call.batches():
                pass
        finally:
            call.cancel()
        return answer or {"object": "text_completion", "choices": [{"text": "hi"}]}
    return run()


async def drive(response: Any, disconnect_after_s: float | None = None,
                on_send: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run an ASGI response, recording what it sends (`on_send` sees the record after each
    message); the client leaves after `disconnect_after_s`."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(sent)

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return sent


def body_of(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.fixture(autouse=True)
def fast_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "FIRST_BYTE_AFTER_S", 0.1)
    monkeypatch.setattr(api, "PROBE_EVERY_S", 0.05)


def test_a_quick_answer_is_a_plain_json_response(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "FIRST_BYTE_AFTER_S", 60.0)  # done long before: however loaded the machine

    async def main() -> None:
        stream = ScriptedStream([], 0.0, 0.0)
        response = await respond(work(stream))
        assert isinstance(response, JSONResponse) and response.status_code == 200
        assert json.loads(response.body)["choices"][0]["text"] == "hi"
    asyncio.run(main())


def test_a_long_answer_starts_early_sends_spaces_then_its_json() -> None:
    async def main() -> None:
        answered = asyncio.Event()  # the work ends once three spaces went out: not after a set time
        stream = ScriptedStream([], 0.0, ends=answered)
        response = await respond(work(stream))
        assert isinstance(response, HeldResponse)

        def after_three_spaces(sent: list[dict[str, Any]]) -> None:
            if body_of(sent).count(b" ") >= 3:
                answered.set()

        sent = await asyncio.wait_for(drive(response, on_send=after_three_spaces), 60)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert (b"content-type", b"application/json") in sent[0]["headers"]
        assert not any(name == b"content-length" for name, _ in sent[0]["headers"])
        body = body_of(sent)
        spaces = len(body) - len(body.lstrip())
        assert spaces >= 3 and body[:spaces] == b" " * spaces
        assert json.loads(body)["choices"][0]["text"] == "hi"
        assert sent[-1]["more_body"] is False
    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_work_and_aborts_the_engine_call() -> None:
    async def main() -> None:
        stream = ScriptedStream([], 0.0, ends=asyncio.Event())  # never ends by itself
        response = await respond(work(stream))
        assert isinstance(response, HeldResponse)
        # Bounded only against a hang: the response ends because the client left (the stream never
        # would), and the engine's sequences are aborted.
        sent = await asyncio.wait_for(drive(response, disconnect_after_s=0.2), 60)
        await asyncio.wait_for(stream.cancelled.wait(), 60)
        assert sent[0]["status"] == 200 and body_of(sent).strip() == b""  # spaces only, no body
    asyncio.run(main())


def test_a_failure_before_the_first_item_keeps_its_status() -> None:
    async def main() -> None:
        from service.engine.engine_loop import EngineFailure

        stream = ScriptedStream(EngineFailure(400, "prompt too long"), 0.3, 0.0)
        response = await respond(work(stream))
        assert isinstance(response, JSONResponse) and response.status_code == 400
        assert json.loads(response.body)["error"]["message"] == "prompt too long"
    asyncio.run(main())


def test_a_failure_after_the_response_started_is_the_error_object_in_the_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "FIRST_BYTE_AFTER_S", 0.0)  # the response starts at the first item, before the deadline

    async def main() -> None:
        stream = ScriptedStream([], 0.0, ends=asyncio.Event())  # never ends by itself
        response = await respond(work(stream, timeout_s=0.4))
        assert isinstance(response, HeldResponse)
        sent = await drive(response)
        assert sent[0]["status"] == 200
        error = json.loads(body_of(sent))["error"]
        assert error["code"] == "request_timeout" and "0.4 s" in error["message"]
        assert stream.cancelled.is_set()
    asyncio.run(main())


def test_waiting_for_admission_or_prefill_holds_nothing_back() -> None:
    """Before its first item a request's status is not known: no early start, however long it takes."""
    async def main() -> None:
        stream = ScriptedStream([], 0.4, 0.0)  # a slow prefill, then done at once
        response = await respond(work(stream))
        assert isinstance(response, JSONResponse) and response.status_code == 200
    asyncio.run(main())
