"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's
Responses API on the chat path (`OpenAIServing.start_chat`).

A stream is server-sent events with `event: <type>` lines, the sequence the `openai` client's
`responses.stream()` accumulates: `response.created`, `response.in_progress`, per output item
`output_item.added` ... `output_item.done`, then `response.completed` (or
`response.incomplete` when cut by `max_output_tokens`). Stored responses (`store`, the default)
live in this replica's `ResponseStore`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from service.errors import APIError
from service.openai.chat_run import ChatRun
from service.openai.responses import OutputWriter, chat_request, new_id, rename_error, response_body
from service.openai.responses_protocol import InputItem, ResponsesRequest, parse_items
from service.openai.responses_store import MissingResponse, ResponseStore
from service.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)


def _not_found(response_id: str) -> APIError:
    return APIError(f"No response with id '{response_id}' is stored on this server (responses are kept in "
                    "memory, a bounded number, and only with store: true).", 404, "invalid_request_error",
                    "response_id", "response_not_found")


class ResponsesServing:
    """The Responses API of one replica: its requests run through `serving`, finished ones are
    kept in `store`."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.serving = serving
        self.store = store or ResponseStore()

    def _conversation(self, req: ResponsesRequest) -> list[InputItem]:
        if req.previous_response_id is None:
            return req.input
        try:
            earlier = self.store.conversation(req.previous_response_id)
        except MissingResponse as exc:
            raise APIError(f"Previous response with id '{exc.response_id}' not found: it was never stored here, "
                           "was deleted or evicted, or is held by another replica.", 400, "invalid_request_error",
                           "previous_response_id", "previous_response_not_found") from None
        return parse_items(earlier, "previous_response_id") + req.input

    async def create(self, req: ResponsesRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A Response object, or its stream of SSE events."""
        chat = chat_request(req, self._conversation(req))
        response_id = new_id("resp")
        try:
            run = await self.serving.start_chat(chat, response_id)
        except APIError as exc:
            raise rename_error(exc) from None
        turn = _Turn(self, req, run, response_id)
        if req.stream:
            return turn.stream()
        async for deltas in run.deltas():
            for d in deltas:
                turn.writer.feed(d.events)
        return turn.finish()[1]

    def retrieve(self, response_id: str) -> dict[str, Any]:
        try:
            return self.store.get(response_id).body
        except MissingResponse:
            raise _not_found(response_id) from None

    def delete(self, response_id: str) -> dict[str, Any]:
        try:
            self.store.delete(response_id)
        except MissingResponse:
            raise _not_found(response_id) from None
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Turn:
    """One request's run, written as a Response (and stored when asked)."""

    def __init__(self, owner: ResponsesServing, req: ResponsesRequest, run: ChatRun, response_id: str) -> None:
        self.owner, self.req, self.run, self.id = owner, req, run, response_id
        self.created_at = int(time.time())
        self.model = owner.serving.info.served_model_name
        self.writer = OutputWriter(run.call_id)

    def _body(self, status: str, with_usage: bool, reason: str | None = None) -> dict[str, Any]:
        return response_body(self.id, self.created_at, self.model, self.req.echo(), self.writer.items, status,
                             self.run.usage() if with_usage else None, reason)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Close the output; the events that closed it and the final response (stored when asked)."""
        reason = self.run.finish_reason(0)
        cut = reason in ("length", "abort")  # abort: the engine stopped it (e.g. the request deadline)
        closing = self.writer.finish(complete=not cut)
        body = self._body("incomplete" if cut else "completed", True,
                          "max_output_tokens" if reason == "length" else None)
        if self.req.store:
            own = [item.model_dump(by_alias=True, exclude_none=True) for item in self.req.input]
            self.owner.store.put(json.loads(json.dumps(body)), own, self.req.previous_response_id)
        return closing, body

    async def stream(self) -> AsyncIterator[str]:
        seq = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal seq
            data = json.dumps(payload | {"sequence_number": seq}, ensure_ascii=False)
            line = f"event: {payload['type']}\ndata: {data}\n\n"
            seq += 1
            return line

        try:
            start = self._body("in_progress", False)
            yield event({"type": "response.created", "response": start})
            yield event({"type": "response.in_progress", "response": start})
            async for deltas in self.run.deltas():
                for d in deltas:
                    for e in self.writer.feed(d.events):
                        yield event(e)
            closing, body = self.finish()
            for e in closing:
                yield event(e)
            done = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield event({"type": done, "response": body})
        except APIError as exc:
            yield event({"type": "error", "code": exc.code or exc.type, "message": exc.message, "param": exc.param})
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("responses stream failed")
            yield event({"type": "error", "code": "server_error", "message": "Internal error while streaming.",
                         "param": None})


def add_responses_routes(app: FastAPI, serving: OpenAIServing, max_body_bytes: int,
                         read_model: Callable[..., Awaitable[Any]],
                         respond: Callable[[Awaitable[Any]], Awaitable[Response]]) -> ResponsesServing:
    """Register the Responses routes on `app` (one store per call: per replica)."""
    responses = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        async def work() -> Any:
            return await responses.create(await read_model(request, ResponsesRequest, max_body_bytes))
        return await respond(work())

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        async def work() -> Any:
            return responses.retrieve(response_id)
        return await respond(work())

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        async def work() -> Any:
            return responses.delete(response_id)
        return await respond(work())

    return responses
