"""Pydantic models of the Anthropic Messages API request bodies, and their conversion into the
internal chat request (`service.openai.protocol.ChatCompletionRequest`).

Anthropic's API rejects fields it does not know, and so does this one: a field not declared here
is a 400 naming it. Declared fields that say nothing to the model are accepted and ignored:
`metadata`, `service_tier`, `speed`, `inference_geo`, `user_profile_id`, `workspace_id`,
`diagnostics`, `cache_control` (this server's prefix cache needs no hints; its hits are reported
as `cache_read_input_tokens`), `citations` and `signature` in history. Sampling fields
(`temperature`, `top_p`, `top_k`) are honoured; recent SDKs send them only through `extra_body`.

Decisions where the two APIs differ:
- `thinking` blocks in assistant history become the message's reasoning (`reasoning_content`),
  which the chat template keeps or drops as the model was trained (Qwen3 keeps it only for the
  turn in progress), just as Anthropic strips earlier turns' thinking. `redacted_thinking` cannot
  be read here and is a 400.
- `thinking: {"type": "disabled"}` renders the template with `enable_thinking: false`; a template
  that still leaves the answer thinking is a 400. `enabled` (and `adaptive`) leave the model's
  default; `budget_tokens` is checked as Anthropic checks it (>= 1024, < max_tokens) and bounds
  the thinking only through `max_tokens`, which bounds the whole answer. A model that does not
  think answers without a thinking block.
- A `tool_result` with `is_error: true` reaches the model as its text prefixed with "Error: ".
- A last message from the assistant (a prefilled answer) is a 400: continuing it is not supported.
- `image` blocks (in user messages and inside `tool_result` content) become the chat request's
  `image_url` parts: a `base64` source as a data URL, a `url` source as its URL, which the edge
  loads under its limits (service/http/images.py); a `file` source (the Files API) is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from service.errors import APIError, from_validation_error

MIN_THINKING_BUDGET = 1024  # Anthropic's lower bound for budget_tokens
ERROR_PREFIX = "Error: "  # a failed tool's result, as the model reads it


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: the prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None  # output annotations echoed back in history


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    input: dict[str, Any]


IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's


class Base64Source(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["base64"]
    media_type: Literal[IMAGE_MEDIA_TYPES]  # the tuple's four values
    data: Annotated[str, Field(min_length=1)]


class URLSource(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["url"]
    url: Annotated[str, Field(min_length=1)]


class ImageBlock(_Block):
    type: Literal["image"]
    source: Base64Source | URLSource

    @field_validator("source", mode="plain")
    @classmethod
    def _one_source(cls, source: Any) -> Base64Source | URLSource:
        kind = source.get("type") if isinstance(source, dict) else None
        if kind == "file":
            raise ValueError("a file source (the Files API) is not supported by this server; send the image as a "
                             "base64 or url source")
        model = {"base64": Base64Source, "url": URLSource}.get(kind)  # type: ignore[arg-type]
        if model is None:
            raise ValueError(f'source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", '
                             f'"url"}}, got type {kind!r}')
        try:
            return model.model_validate(source)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "literal_error" and where == "media_type":
                raise ValueError(f"source.media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}, got "
                                 f"{source.get('media_type')!r}") from None
            raise ValueError(f"source.{where}: {err['msg']}") from None

    def chat_part(self) -> dict[str, Any]:
        """The chat request's `image_url` part for this image."""
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if isinstance(src, Base64Source) else src.url
        return {"type": "image_url", "image_url": {"url": url}}


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False

    @field_validator("content", mode="plain")
    @classmethod
    def _text_and_images(cls, content: Any) -> str | list[TextBlock | ImageBlock] | None:
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or an array of text and image blocks")
        blocks = [_block(k, block, ("text", "image")) for k, block in enumerate(content)]
        return blocks  # type: ignore[return-value]

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The tool message's content: text (blocks joined by newlines), or with images its parts in
        order; a failed tool's result starts with ERROR_PREFIX."""
        prefix = ERROR_PREFIX if self.is_error else ""
        blocks = self.content if isinstance(self.content, list) else []
        if not any(isinstance(b, ImageBlock) for b in blocks):
            body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in blocks)
            return prefix + body
        parts = [{"type": "text", "text": prefix}] if prefix else []
        for k, b in enumerate(blocks):
            sep = "\n" if k and isinstance(b, TextBlock) and isinstance(blocks[k - 1], TextBlock) else ""
            parts.append(b.chat_part() if isinstance(b, ImageBlock) else {"type": "text", "text": sep + b.text})
        return parts


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # Anthropic's proof of origin: this server writes "" and checks none


BLOCK_TYPES: dict[str, type[_Block]] = {"text": TextBlock, "image": ImageBlock, "tool_use": ToolUseBlock,
                                        "tool_result": ToolResultBlock, "thinking": ThinkingBlock}
Block = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


def _block(j: int, block: Any, kinds: tuple[str, ...] = tuple(BLOCK_TYPES)) -> Block:
    """Block `j` of a message's content (of one of `kinds`); ValueError saying which block and
    field is wrong (a type this server cannot honour, such as document, is one)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise ValueError(f"block {j} has type {kind!r}, which this server does not support here "
                         f"(supported: {', '.join(kinds)})")
    try:
        return BLOCK_TYPES[kind].model_validate(block)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ValueError(f"block {j} ({kind}): field {where!r} is not supported by this server; "
                             "leave it out") from None
        reason = (err.get("ctx") or {}).get("error", err["msg"]) if err["type"] == "value_error" else err["msg"]
        raise ValueError(f"block {j} ({kind}): {where}: {reason}") from None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="plain")
    @classmethod
    def _check_blocks(cls, content: Any) -> str | list[Any]:
        # Plain validation: errors name the block and its field, not pydantic's union members.
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("must be a string or an array of content blocks")
        return [_block(j, block) for j, block in enumerate(content)]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> "Message":
        wrong = {"user": (ToolUseBlock, ThinkingBlock), "assistant": (ToolResultBlock, ImageBlock)}[self.role]
        for j, block in enumerate(self.blocks):
            if isinstance(block, wrong):
                raise ValueError(f"content[{j}]: a {block.type} block cannot be in a {self.role} message")
        return self

    @property
    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["custom"] | None = None  # server tools (web_search_..., bash_...) are not served here
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice needs "name" exactly when its type is "tool"')
        return self


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)] | None = None

    @model_validator(mode="after")
    def _budget_iff_enabled(self) -> "Thinking":
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError('thinking needs "budget_tokens" exactly when its type is "enabled"')
        return self


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: `format` constrains the text to a JSON schema (as `response_format` does on
    the chat route); `effort` is accepted and, like `budget_tokens`, bounds nothing here."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: Annotated[str, Field(max_length=256)] | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what the prompt is made of."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolSpec], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="after")
    def _history_holds_together(self) -> "CountTokensRequest":
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message must be from the user; continuing a prefilled "
                             "assistant answer is not supported by this server")
        seen: set[str] = set()
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.blocks):
                if isinstance(block, ToolUseBlock):
                    seen.add(block.id)
                elif isinstance(block, ToolResultBlock) and block.tool_use_id not in seen:
                    raise ValueError(f"messages[{i}].content[{j}].tool_use_id {block.tool_use_id!r} answers no "
                                     "tool_use block of an earlier assistant message")
        names = [t.name for t in self.tools or []]
        if self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names tool {self.tool_choice.name!r}, which is not in tools "
                             f"({', '.join(names) or 'none given'})")
        if self.tool_choice is not None and self.tool_choice.type == "any" and not names:
            raise ValueError('tool_choice "any" needs at least one tool in tools')
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The internal chat request's fields for the prompt: messages, tools, tool choice, thinking."""
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema}
                                | ({"description": t.description} if t.description is not None else {})}
                               for t in self.tools]
        choice = self.tool_choice
        if choice is not None and self.tools:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}})
            if choice.disable_parallel_tool_use is not None:
                fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None and self.thinking.type == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return fields

    def _chat_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for message in self.messages:
            blocks = message.blocks
            out.extend(_user_messages(blocks) if message.role == "user" else [_assistant_message(blocks)])
        return out


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    # Accepted, and say nothing to this server: who asks, where and how fast it should run,
    # caching hints (the prefix cache needs none) and cache diagnostics (none are reported).
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_control: dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> "MessagesRequest":
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens must be less than max_tokens ({self.max_tokens}), got {budget}")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The internal chat request's fields (sampling fields only when sent, so the model's
        generation_config defaults fill the others, as on /v1/chat/completions)."""
        fields = super().chat_fields() | {"max_tokens": self.max_tokens, "stream": False}
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.output_config is not None and self.output_config.format is not None:
            fields["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        return fields


def _user_messages(blocks: list[Any]) -> list[dict[str, Any]]:
    """One user turn: each tool_result a tool message, runs of text and images a user message, in
    order (its text joined into one string when it has no image)."""
    out: list[dict[str, Any]] = []
    run: list[TextBlock | ImageBlock] = []
    for block in blocks:
        if isinstance(block, (TextBlock, ImageBlock)):
            run.append(block)
            continue
        if run:
            out.append({"role": "user", "content": _user_content(run)})
            run = []
        out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.chat_content()})
    if run or not out:
        out.append({"role": "user", "content": _user_content(run)})
    return out


def _user_content(run: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    if not any(isinstance(b, ImageBlock) for b in run):
        return "".join(b.text for b in run)  # type: ignore[union-attr]
    return [b.chat_part() if isinstance(b, ImageBlock) else {"type": "text", "text": b.text} for b in run]


def _assistant_message(blocks: list[Any]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def parse_error(exc: ValidationError) -> APIError:
    """A validation failure as a 400 naming the Anthropic field (an unknown one by its name)."""
    err = exc.errors(include_url=False)[0] if exc.errors() else None
    if err is not None and err["type"] == "extra_forbidden":
        path = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"]).replace(".[", "[")
        return APIError(f"{path}: this field is not supported by this server; leave it out", param=path)
    return from_validation_error(exc)
