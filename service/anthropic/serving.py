"""The Messages API over the chat path: an Anthropic request becomes the internal chat request,
runs as a `ChatRun` (service/openai/chat_run.py), and its answer events become content blocks.

One state machine (`BlockWriter`) turns answer events into the stream's block events; the
non-streamed message is those same events folded together, so both always agree. A run of
whitespace-only text or thinking opens no block, and a block's leading whitespace is dropped
(Qwen3 writes "\\n\\n" after `</think>`), wherever the engine's steps cut the text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import ValidationError

from service.anthropic.protocol import CountTokensRequest, MessagesRequest
from service.errors import APIError, from_validation_error
from service.openai.chat_run import ChatRun, ChatUsage
from service.openai.protocol import ChatCompletionRequest
from service.openai.serving import OpenAIServing
from service.tools.answer import AnswerEvent, ReasoningEvent
from service.tools.parser import ArgumentsEvent, CallStartEvent, TextEvent
from service.tools.reasoning import ReasoningMode

logger = logging.getLogger(__name__)

# Internal chat fields by the Anthropic field a client sent (errors name what the client sent).
_CLIENT_FIELDS = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice", "chat_template_kwargs": "thinking"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
# Anthropic's error types by HTTP status (the statuses are the OpenAI routes' own).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error"}


def error_body(exc: APIError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event with its `event:` line, as Anthropic streams."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _client_names(exc: APIError) -> APIError:
    """An internal request's error naming the Anthropic field instead of the internal one."""
    if exc.param is None:
        return exc
    root = re.split(r"[.\[]", exc.param)[0]
    name = _CLIENT_FIELDS.get(root, root)  # internal message indexes are not the client's: "messages"
    if name == exc.param:
        return exc
    own = any(exc.message.startswith(exc.param + tail) for tail in (" must", " is", ":"))
    message = name + exc.message[len(exc.param):] if own else f"{name}: {exc.message}"
    return APIError(message, exc.status, exc.type, name, exc.code, exc.headers)


class BlockWriter:
    """Answer events -> `content_block_start/delta/stop` events, block by block."""

    _KINDS = {ReasoningEvent: "thinking", TextEvent: "text"}

    def __init__(self, call_id: Callable[[], str]) -> None:
        self._call_id = call_id
        self._index = -1
        self._kind: str | None = None  # of the open block
        self._held = ""  # whitespace that would open a block alone: sent with the text after it

    def feed(self, events: list[AnswerEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, CallStartEvent):
                out += self._open({"type": "tool_use", "id": self._call_id(), "name": event.name, "input": {}})
            elif isinstance(event, ArgumentsEvent):
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
            else:
                out += self._text(self._KINDS[type(event)], event.text)
        return out

    def close(self) -> list[dict[str, Any]]:
        """The last block's stop."""
        if self._kind is None:
            return []
        self._kind = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._kind != kind:
            # No block of whitespace alone; whitespace followed by text stays, as chat sends it.
            text, self._held = self._held + text, ""
            if not text.strip():
                self._held = text
                return []
            out += self._open({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        if text:
            out.append(self._delta({"type": "thinking_delta", "thinking": text} if kind == "thinking"
                                   else {"type": "text_delta", "text": text}))
        return out

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self._index += 1
        self._kind = block["type"]
        return out + [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}


def fold_blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks that block events add up to (tool inputs parsed; a call cut short by
    max_tokens keeps an empty input)."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            d, block = e["delta"], blocks[e["index"]]
            if d["type"] == "input_json_delta":
                arguments[e["index"]] = arguments.get(e["index"], "") + d["partial_json"]
            else:
                key = "text" if d["type"] == "text_delta" else "thinking"
                block[key] += d[key]
    for index, text in arguments.items():
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        blocks[index]["input"] = parsed if isinstance(parsed, dict) else {}
    return blocks


class MessagesServing:
    """`/v1/messages` and `/v1/messages/count_tokens` over one `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self._serving = serving

    def chat_request(self, req: CountTokensRequest) -> ChatCompletionRequest:
        """The internal chat request; APIError (naming the Anthropic field) when it is invalid."""
        try:
            chat = ChatCompletionRequest.model_validate(req.chat_fields())
        except ValidationError as exc:
            raise _client_names(from_validation_error(exc)) from None
        if req.thinking is not None and req.thinking.type == "disabled" and self._serving.reasoning:
            if ReasoningMode.of_prompt(self._serving.render_chat(chat)).thinks:
                raise APIError('thinking: this model\'s chat template cannot turn thinking off; leave out '
                               '{"type": "disabled"}', param="thinking")
        return chat

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, Any]:
        """{"input_tokens": N}: the prompt tokens `/v1/messages` counts for the same request (each
        image's tokens included)."""
        self._serving.check_model(req.model)
        try:
            prompt = await self._serving.chat_prompt(self.chat_request(req))
        except APIError as exc:
            raise _client_names(exc) from None
        return {"input_tokens": len(prompt.ids)}

    async def create(self, req: MessagesRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A message body, or its SSE events when `req.stream`."""
        self._serving.check_model(req.model)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            run = await self._serving.start_chat(self.chat_request(req), message_id)
        except APIError as exc:
            raise _client_names(exc) from None
        if req.stream:
            prompt = ChatUsage(run.num_prompt_tokens, 0, 0, 0)  # before the prefix-cache lookup
            return self._stream(run, self._message(message_id, [], None, None, _usage(prompt)))
        writer = BlockWriter(run.call_id)
        events = writer.feed((await run.collect())[0]) + writer.close()
        reason, stop = self._stop(run)
        return self._message(message_id, fold_blocks(events), reason, stop, _usage(run.usage()))

    def _message(self, message_id: str, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self._serving.info.served_model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def _stop(run: ChatRun) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished run."""
        reason = run.finish_reason(0)
        if reason == "abort":
            raise APIError("The request was aborted by the engine.", 500, "api_error")
        matched = run.stop_reasons[0]
        if reason == "stop" and isinstance(matched, str):
            return "stop_sequence", matched
        return _STOP_REASONS.get(reason or "", "end_turn"), None

    async def _stream(self, run: ChatRun, start: dict[str, Any]) -> AsyncIterator[str]:
        """message_start (its usage counts the prompt before the prefix-cache lookup), ping, the
        blocks, message_delta (the final usage), message_stop; an error after the start is an
        `error` event."""
        writer = BlockWriter(run.call_id)
        try:
            yield sse({"type": "message_start", "message": start})
            yield sse({"type": "ping"})
            async for deltas in run.deltas():
                for event in writer.feed([e for d in deltas for e in d.events]):
                    yield sse(event)
            for event in writer.close():
                yield sse(event)
            reason, stop = self._stop(run)
            yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                       "usage": _usage(run.usage())})
            yield sse({"type": "message_stop"})
        except APIError as exc:
            yield sse(error_body(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("messages stream failed")
            yield sse(error_body(APIError("Internal error while streaming.", 500, "api_error")))
        finally:  # a client that left: abort what still runs
            run.cancel()


def _usage(usage: ChatUsage) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the prefix cache."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}
