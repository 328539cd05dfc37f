"""The Responses API over the chat path: a `ResponsesRequest` becomes the internal chat request,
the run's answer events become output items (reasoning, message, function_call) and the typed
stream events that build them, in the shapes of OpenAI's `Response` and stream event models.

One `OutputWriter` serves both the streamed and the whole answer, so the final response of a
stream is the response the same request answers without streaming.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from service.errors import APIError, from_validation_error
from service.openai.chat_run import ChatUsage
from service.openai.protocol import ChatCompletionRequest
from service.openai.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem,
                                               ReasoningItem, ResponsesRequest, chat_content)
from service.tools.answer import AnswerEvent, ReasoningEvent
from service.tools.parser import ArgumentsEvent, CallStartEvent, TextEvent

# Chat request fields and the Responses fields they came from, for error messages.
_FIELD_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text.format", "chat_template_kwargs": "reasoning.effort"}

Event = dict[str, Any]  # a stream event without its sequence_number


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of a conversation: instructions as the system message; an assistant
    message and the calls after it as one assistant message with `tool_calls`; call outputs as
    tool messages; a reasoning item's text as the reasoning of the assistant message after it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or []) or None
        elif isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": chat_content(item.content)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                messages.append(message)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": chat_content(item.output)})
    return messages


def rename_error(exc: APIError) -> APIError:
    """An error of the internal chat request, naming the Responses field it came from."""
    param = exc.param or ""
    base = re.match(r"[a-z_]*", param).group()
    if base == "tools":
        new = param.replace(".function", "", 1)
    elif base in _FIELD_NAMES:
        new = _FIELD_NAMES[base]
    else:
        return exc
    message = exc.message.replace(param, new, 1) if param in exc.message else exc.message
    if message.startswith(base) and base != "tools":
        message = new + message[len(base):]
    return APIError(message, exc.status, exc.type, new, exc.code, exc.headers)


def chat_request(req: ResponsesRequest, items: list[InputItem]) -> ChatCompletionRequest:
    """The internal chat request of a Responses request whose conversation is `items`."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req.instructions, items), "stream": False}
    if not body["messages"]:
        raise APIError("input must hold at least one item (or give previous_response_id)", param="input")
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "priority"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    if choice is not None and (req.tools or choice != "auto"):
        body["tool_choice"] = choice
    if req.text is not None and req.text.format is not None and req.text.format.type != "text":
        try:
            body["response_format"] = req.text.format.response_format()
        except ValueError as exc:
            raise APIError(str(exc), param="text.format") from None
    if req.reasoning is not None and req.reasoning.effort is not None:
        # gpt-oss templates read reasoning_effort; hybrid thinkers (Qwen3) switch off with enable_thinking
        kwargs: dict[str, Any] = {"reasoning_effort": req.reasoning.effort}
        if req.reasoning.effort == "none":
            kwargs["enable_thinking"] = False
        body["chat_template_kwargs"] = kwargs
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise rename_error(from_validation_error(exc)) from None


def usage_body(usage: ChatUsage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def response_body(response_id: str, created_at: int, model: str, echo: dict[str, Any], output: list[dict[str, Any]],
                  status: str, usage: ChatUsage | None, incomplete_reason: str | None = None) -> dict[str, Any]:
    """A Response object."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
            "incomplete_details": {"reason": incomplete_reason} if status == "incomplete" else None,
            "model": model, "output": output, "usage": None if usage is None else usage_body(usage)} | echo


class OutputWriter:
    """Answer events in, output items and their stream events out. An item is open while events
    of its kind arrive and is closed (its `.done` events) when another kind starts or the answer
    ends. Whitespace between calls (or before the first text) is not an item of its own."""

    def __init__(self, call_id: Callable[[], str]) -> None:
        self.items: list[dict[str, Any]] = []
        self._call_id = call_id
        self._open: dict[str, Any] | None = None
        self._held = ""  # whitespace text not yet shown: it only matters when text follows
        self._calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def feed(self, events: list[AnswerEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, (ReasoningEvent, TextEvent)) and not event.text:
                continue
            if isinstance(event, ReasoningEvent):
                self._reasoning(event.text, out)
            elif isinstance(event, TextEvent):
                self._message_text(event.text, out)
            elif isinstance(event, CallStartEvent):
                self._call_start(event, out)
            elif isinstance(event, ArgumentsEvent) and event.index in self._calls:
                item = self._calls[event.index]
                item["arguments"] += event.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                            "output_index": self._index(item), "delta": event.text})
        return out

    def finish(self, complete: bool) -> list[Event]:
        """Close the last item: "completed", or "incomplete" when the answer was cut."""
        return self._close("completed" if complete else "incomplete")

    def _index(self, item: dict[str, Any]) -> int:
        return next(k for k, it in enumerate(self.items) if it is item)

    def _start(self, item: dict[str, Any], out: list[Event]) -> dict[str, Any]:
        out.extend(self._close("completed"))
        self.items.append(item)
        self._open = item
        added = {k: (list(v) if isinstance(v, list) else v) for k, v in item.items()}
        out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added})
        return item

    def _reasoning(self, text: str, out: list[Event]) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = self._start({"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                                "status": "in_progress"}, out)
            item["content"].append({"type": "reasoning_text", "text": ""})
            out.append(self._part_event("added", item, {"type": "reasoning_text", "text": ""}))
        item["content"][0]["text"] += text
        out.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self._index(item),
                    "content_index": 0, "delta": text})

    def _message_text(self, text: str, out: list[Event]) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            if not (self._held + text).strip():
                self._held += text
                return
            text, self._held = self._held + text, ""  # kept, as chat sends it
            item = self._start({"type": "message", "id": new_id("msg"), "status": "in_progress", "role": "assistant",
                                "content": []}, out)
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self._part_event("added", item, {"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []}))
        item["content"][0]["text"] += text
        out.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": self._index(item),
                    "content_index": 0, "delta": text, "logprobs": []})

    def _call_start(self, event: CallStartEvent, out: list[Event]) -> None:
        self._held = ""
        item = self._start({"type": "function_call", "id": new_id("fc"), "call_id": self._call_id(),
                            "name": event.name, "arguments": "", "status": "in_progress"}, out)
        self._calls[event.index] = item

    def _part_event(self, what: str, item: dict[str, Any], part: dict[str, Any]) -> Event:
        return {"type": f"response.content_part.{what}", "item_id": item["id"], "output_index": self._index(item),
                "content_index": 0, "part": part}

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = self._index(item)
        out: list[Event] = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": text})
            out.append(self._part_event("done", item, dict(item["content"][0])))
        elif item["type"] == "message":
            part = item["content"][0]
            out.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": []})
            out.append(self._part_event("done", item, dict(part)))
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                        "name": item["name"], "arguments": item["arguments"]})
        out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return out
