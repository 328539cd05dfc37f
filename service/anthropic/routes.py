"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (the Anthropic Messages API), added
to the HTTP edge by `service.server.api.build_api`. Every failure on these routes leaves in Anthropic's
error shape, with the HTTP status the OpenAI routes use for the same failure."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, RootModel, ValidationError
from starlette.responses import JSONResponse, Response

from service.anthropic.protocol import CountTokensRequest, MessagesRequest, parse_error
from service.anthropic.serving import MessagesServing, error_body
from service.errors import APIError
from service.openai.serving import OpenAIServing

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


def add_messages_routes(app: FastAPI, serving: OpenAIServing, max_body_bytes: int,
                        read_model: Callable[..., Awaitable[Any]], respond: Callable[..., Awaitable[Response]]) -> None:
    """Register the Messages API routes on `app`; `read_model` is the edge's body reader."""
    messages = MessagesServing(serving)

    @app.post(MESSAGES_PATH)
    async def create_message(request: Request) -> Response:
        async def work() -> Any:
            return await messages.create(await _read(request, MessagesRequest, max_body_bytes, read_model))
        return await respond(work(), anthropic_error_response)

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def work() -> Any:
            return await messages.count_tokens(await _read(request, CountTokensRequest, max_body_bytes, read_model))
        return await respond(work(), anthropic_error_response)
