"""Pydantic models of `POST /v1/responses` (OpenAI's Responses API): JSON in, the internal chat
request out (`ResponsesRequest.chat_request`).

As in `protocol.py`: unknown fields are ignored, but a known field this server does not
implement is a 400 naming it unless it has its neutral value (`UNSUPPORTED_RESPONSES`). Input
items hold text and `input_image` parts (by `image_url`; a `file_id` is a 400); items and tools
of kinds this server cannot honour are 400s naming them.
Hosted tools that OpenAI's own clients send by default (`IGNORED_TOOL_TYPES`: Codex adds
`web_search`) are dropped with a warning, as llama.cpp does: the model just does not get them.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from service.errors import from_validation_error
from service.openai.protocol import FunctionSpec, ranged, reject_unsupported

logger = logging.getLogger(__name__)

MAX_INPUT_ITEMS = 2048
MAX_TOOLS = 128
MAX_METADATA_KEYS = 16
# Known Responses fields that are not implemented, with their neutral values.
UNSUPPORTED_RESPONSES: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "truncation": ("disabled",),  # "auto" would drop input to fit the context
}
# Hosted tools OpenAI runs on its own servers, sent by default by OpenAI's clients (Codex CLI).
IGNORED_TOOL_TYPES = frozenset({"web_search", "web_search_preview", "image_generation"})
# `include` values that ask for output this server does not produce.
UNSUPPORTED_INCLUDES = frozenset({"message.output_text.logprobs"})

Role = Literal["user", "assistant", "system", "developer"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextContent(_Model):
    """A text part of a message: `input_text` (also `output_text` of earlier answers)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class ReasoningText(_Model):
    type: Literal["reasoning_text"]
    text: str


class ImageContent(_Model):
    """An `input_image` part: `image_url` is a data URL or a URL the server may fetch
    (service/http/images.py); `file_id` (OpenAI's Files API) is refused."""

    type: Literal["input_image"]
    image_url: Annotated[str, Field(min_length=1)] | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"


Content = str | list[TextContent | ImageContent]
_PART_TYPES = ("input_text", "output_text", "text", "input_image")


def chat_content(content: Content) -> str | list[dict[str, Any]]:
    """The chat message content of `content`: its text joined, or with images its parts in order."""
    if isinstance(content, str):
        return content
    if not any(isinstance(p, ImageContent) for p in content):
        return "".join(p.text for p in content)  # type: ignore[union-attr]
    return [{"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}}
            if isinstance(p, ImageContent) else {"type": "text", "text": p.text} for p in content]


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Role
    content: Content

    @field_validator("content", mode="plain")
    @classmethod
    def _parts(cls, content: Any) -> Content:
        return _check_content(content)


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: str
    arguments: str


class FunctionCallOutputItem(_Model):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: Content

    @field_validator("output", mode="plain")
    @classmethod
    def _parts(cls, content: Any) -> Content:
        return _check_content(content)


class ReasoningItem(_Model):
    """An earlier turn's reasoning: its `reasoning_text` reaches the template as the next
    assistant message's reasoning; `summary` and `encrypted_content` are dropped."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_MODELS: dict[str, type[_Model]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                          "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}


def _check_content(content: Any) -> Content:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("must be a string or an array of input_text and input_image parts")
    parts: list[TextContent | ImageContent] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PART_TYPES:
            raise ValueError(f"part {j} has type {kind!r}; this server takes {', '.join(_PART_TYPES)}")
        if kind == "input_image":
            parts.append(_image_part(j, part))
            continue
        try:
            parts.append(TextContent.model_validate(part))
        except ValidationError:
            raise ValueError(f'part {j} must be {{"type": "{kind}", "text": <string>}}') from None
    return parts


def _image_part(j: int, part: dict[str, Any]) -> ImageContent:
    try:
        image = ImageContent.model_validate(part)
    except ValidationError as exc:
        raise ValueError(f"part {j} (input_image): {from_validation_error(exc).message}") from None
    if image.file_id is not None:
        raise ValueError(f"part {j} (input_image): file_id is not supported by this server (it has no Files API); "
                         "send the image as image_url, a data:image/...;base64 URL")
    if image.image_url is None:
        raise ValueError(f"part {j} (input_image): image_url is required")
    return image


def parse_items(raw: Any, param: str = "input") -> list[InputItem]:
    """Input items (a string is one user message); a bad item is a ValueError naming it."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    if not isinstance(raw, list):
        raise ValueError(f"{param} must be a string or an array of input items")
    if len(raw) > MAX_INPUT_ITEMS:
        raise ValueError(f"{param} may have at most {MAX_INPUT_ITEMS} items, got {len(raw)}")
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        model = _ITEM_MODELS.get(kind)  # type: ignore[arg-type]
        if model is None:
            raise ValueError(f"{param}[{i}] has type {kind!r}; supported item types: {', '.join(_ITEM_MODELS)}")
        try:
            items.append(model.model_validate(item))  # type: ignore[arg-type]
        except ValidationError as exc:
            raise ValueError(f"{param}[{i}] ({kind}): {from_validation_error(exc).message}") from None
    return items


class FunctionTool(FunctionSpec):
    """A Responses function tool: the chat `function` fields at the top level."""

    type: Literal["function"]


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """The chat `response_format` of this text format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise ValueError('text.format.schema is required when type is "json_schema"')
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}

    def echo(self) -> dict[str, Any]:
        out = {"type": self.type}
        if self.type == "json_schema":
            out |= {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return out


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models: ignored


class ReasoningConfig(_Model):
    """Accepted; `effort` reaches the chat template as `reasoning_effort` (gpt-oss templates
    read it), and "none" also as `enable_thinking: false` (Qwen3's hybrid thinking off); a
    thinking model's reasoning comes back whole as `reasoning` items."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Model):
    """`POST /v1/responses`."""

    model: str | None = None
    input: Any = Field(default=None, validate_default=True)
    instructions: str | None = None
    max_output_tokens: Annotated[int, ranged("max_tokens")] | None = None
    temperature: Annotated[float, ranged("temperature")] | None = None
    top_p: Annotated[float, ranged("top_p")] | None = None
    tools: Any = Field(default=None, validate_default=True)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_KEYS)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    store: bool = True
    # vLLM's extension, as on chat: lower runs sooner (scheduling_policy "priority"); None: the tenant's default
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] | None = None
    previous_response_id: str | None = None
    stream: bool = False
    include: list[str] | None = None
    # Not implemented (UNSUPPORTED_RESPONSES): a 400 unless neutral.
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    truncation: Any = None

    @field_validator(*UNSUPPORTED_RESPONSES, mode="plain")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(UNSUPPORTED_RESPONSES, value, info.field_name)

    @field_validator("input", mode="plain")
    @classmethod
    def _items(cls, value: Any) -> list[InputItem]:
        return [] if value is None else parse_items(value)

    @field_validator("include")
    @classmethod
    def _include(cls, include: list[str] | None) -> list[str] | None:
        bad = [v for v in include or [] if v in UNSUPPORTED_INCLUDES]
        if bad:
            raise ValueError(f"include {bad[0]!r} is not supported by this server; leave it out")
        return include

    @field_validator("tools", mode="plain")
    @classmethod
    def _tools(cls, tools: Any) -> list[FunctionTool]:
        if tools is None:
            return []
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise ValueError(f"tools must be an array of at most {MAX_TOOLS} tools")
        out = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind in IGNORED_TOOL_TYPES:
                logger.warning("ignoring tools[%d] of type %r: this server runs no hosted tools", i, kind)
                continue
            if kind != "function":
                raise ValueError(f"tools[{i}] has type {kind!r}; this server supports function tools only")
            try:
                out.append(FunctionTool.model_validate(tool))
            except ValidationError as exc:
                raise ValueError(f"tools[{i}]: {from_validation_error(exc).message}") from None
        return out

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _tool_choice(cls, choice: Any) -> str | NamedFunction | None:
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        try:
            return NamedFunction.model_validate(choice)
        except ValidationError:
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": '
                             f"<string>}}, got {choice!r}") from None

    def echo(self) -> dict[str, Any]:
        """The request fields a Response object repeats."""
        choice = self.tool_choice
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning.model_dump(exclude_none=True) if self.reasoning else None,
            "store": self.store, "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": fmt.echo(), "verbosity": self.text.verbosity if self.text else None},
            "tool_choice": (choice.model_dump() if isinstance(choice, NamedFunction) else choice or "auto"),
            "tools": [t.model_dump() for t in self.tools], "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled", "user": self.user, "background": False,
        }
