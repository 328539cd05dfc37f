"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (the Anthropic Messages API), added
to the HTTP edge by `service.api.build_api`. Every failure on these routes leaves in Anthropic's
error shape, with the HTTP status the OpenAI routes use for the same failure."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, RootModel, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from service.anthropic.protocol import CountTokensRequest, MessagesRequest, parse_error
from service.anthropic.serving import MessagesServing, error_body
from service.errors import APIError
from service.openai.serving import OpenAIServing

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"


def anthropic_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


async def _read(request: Request, model: type[BaseModel], max_bytes: int,
                read_model: Callable[..., Awaitable[Any]]) -> Any:
    """The body through the edge's `read_model` (size cap, JSON), validated as `model` here so
    that errors name Anthropic's fields."""
    body = await read_model(request, _RawBody, max_bytes)
    try:
        return model.model_validate(body.root)
    except ValidationError as exc:
        raise parse_error(exc) from None


class _RawBody(RootModel[dict[str, Any]]):
    """Any JSON object: what `read_model` parses before the Anthropic models validate it."""


async def _respond(work: Awaitable[Any]) -> Response:
    """Await a route's work: dicts become JSON, iterators SSE, errors Anthropic's error shape."""
    try:
        result = await work
    except APIError as exc:
        return anthropic_error_response(exc)
    except Exception:
        logger.exception("messages request failed")
        return anthropic_error_response(APIError("Internal server error.", 500, "api_error"))
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def add_messages_routes(app: FastAPI, serving: OpenAIServing, max_body_bytes: int,
                        read_model: Callable[..., Awaitable[Any]]) -> None:
    """Register the Messages API routes on `app`; `read_model` is the edge's body reader."""
    messages = MessagesServing(serving)

    @app.post(MESSAGES_PATH)
    async def create_message(request: Request) -> Response:
        async def work() -> Any:
            return await messages.create(await _read(request, MessagesRequest, max_body_bytes, read_model))
        return await _respond(work())

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def work() -> Any:
            return messages.count_tokens(await _read(request, CountTokensRequest, max_body_bytes, read_model))
        return await _respond(work())
