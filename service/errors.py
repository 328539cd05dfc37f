"""The OpenAI error shape, and turning validation failures into it.

Every error the API returns is `{"error": {"message", "type", "param", "code"}}`. Messages say
what was wrong and what is allowed; they are capped in size and never carry a stack trace.
"""

from __future__ import annotations

import json
import logging
import random
from typing import Any

from pydantic import ValidationError

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 1000
_MAX_VALUE_CHARS = 80


class APIError(Exception):
    """An error with an HTTP status that is sent to the client in the OpenAI shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = _cap(message, MAX_MESSAGE_CHARS)
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {...}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        return json.dumps(self.body())


def retry_after_seconds(retry_after_s: float) -> int:
    """What a `Retry-After` header says for `retry_after_s`: whole seconds, rounded up, at least 1."""
    return max(1, int(-(-retry_after_s // 1)))


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """`Retry-After` in whole seconds, and `retry-after-ms`, which the official OpenAI and
    Anthropic SDKs read first: the wait plus up to one more second at random (at most the wait
    again). Clients refused together would otherwise all come back in the same millisecond, and
    that burst is what a quiet tenant's requests then queue behind."""
    seconds = retry_after_seconds(retry_after_s)
    wait = max(retry_after_s, 0.0)
    jittered = wait + random.uniform(0.0, min(max(wait, 0.1), 1.0))
    return {"Retry-After": str(seconds), "retry-after-ms": str(max(1, round(1000 * jittered)))}


def overloaded_error(status: int, retry_after_s: float) -> APIError:
    """503 (or 429) telling the client to come back after `retry_after_s` seconds."""
    seconds = retry_after_seconds(retry_after_s)
    return APIError(
        f"The server is overloaded: all request slots and the queue are full. Retry after {seconds} s.",
        status=status,
        type="overloaded_error" if status == 503 else "rate_limit_error",
        code="overloaded" if status == 503 else "rate_limit_exceeded",
        headers=retry_after_headers(retry_after_s),
    )


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    """A short rendering of a client-supplied value for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return _cap(text, _MAX_VALUE_CHARS)


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _describe(err: dict[str, Any], param: str) -> str:
    """One pydantic error as "param must be ..., got ..."."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"{param} must be {bounds[kind]} {limit}, got {_show(value)}"
    if kind in _EXPECTED:
        return f"{param} must be {_EXPECTED[kind]}, got {_show(value)}"
    if kind == "missing":
        return f"{param} is required"
    if kind == "too_long":
        return f"{param} may have at most {ctx.get('max_length')} items, got {ctx.get('actual_length')}"
    if kind == "too_short":
        return f"{param} must have at least {ctx.get('min_length')} item(s), got {ctx.get('actual_length')}"
    if kind == "string_too_long":
        return f"{param} may be at most {ctx.get('max_length')} characters long"
    if kind == "literal_error":
        return f"{param} must be one of {ctx.get('expected')}, got {_show(value)}"
    if kind == "value_error":
        reason = str(ctx.get("error", err["msg"]))
        return reason if reason.startswith(param.split("[")[0]) else f"{param}: {reason}"
    return f"{param}: {err['msg']}"


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending parameter."""
    errors = exc.errors(include_url=False)
    if not errors:
        return APIError("Invalid request body")
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    param = _param_path(tuple(err["loc"]))
    if param is None and err["type"] == "value_error":  # a rule over several fields
        return APIError(str((err.get("ctx") or {}).get("error", err["msg"])))
    if param is None:  # the body itself has the wrong type (e.g. a JSON array)
        return APIError(f"The request body must be a JSON object, got {_show(err.get('input'))}")
    return APIError(_describe(err, param), param=param)


def from_value_error(exc: ValueError, known_params: set[str]) -> APIError:
    """A `ValueError` from `SamplingParams` ("top_k must be ...") or `model.sampling.request_checks`
    as a 400. A `RequestError` names its parameter; otherwise the message's first word does
    when it is one."""
    message = str(exc)
    param = getattr(exc, "param", None)
    if param is not None:  # model.sampling.request_checks.RequestError
        return APIError(message, param=param, code=getattr(exc, "code", None))
    first = message.split(" ", 1)[0]
    return APIError(message, param=first if first in known_params else None)
