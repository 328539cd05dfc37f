"""Pydantic models of the OpenAI-compatible request bodies: JSON in, `SamplingParams` out.

Unknown fields are ignored (clients send many), but a known field that would change what the
request means and that this server does not implement is a 400 naming it (`UNSUPPORTED`), never
dropped. Types are strict (a boolean is not "yes", an integer is not 1.5) and every range is
checked here, from the one table of ranges (`model.sampling.params.PARAM_RANGES`), so a bad
field is a 400 naming it. Response bodies are built in `service/openai/formats.py`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from model.sampling.params import PARAM_RANGES, SamplingParams

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request
MAX_STOP = 8  # stop strings
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # length of one stop string
MAX_MESSAGES = 512
MAX_LOGIT_BIAS_TOKENS = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

# Known fields this server does not implement, with their neutral values: any other value
# changes what the request means, so it is a 400 naming the field rather than ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0),
    "use_beam_search": (False,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
}
UNSUPPORTED_COMPLETIONS = {"suffix": ("",)}
UNSUPPORTED_CHAT = {"echo": (False,), "continue_final_message": (False,), "audio": (), "modalities": (["text"],)}

Prompt = Union[str, list[int]]


def ranged(name: str) -> Any:
    """The pydantic constraint of parameter `name`, from the one table of ranges."""
    r = PARAM_RANGES[name]
    lower = {} if r.lo is None else {"gt" if r.lo_open else "ge": r.lo}
    return Field(**lower, **({} if r.hi is None else {"le": r.hi}))


def reject_unsupported(table: dict[str, tuple[Any, ...]], value: Any, name: str) -> Any:
    if value is not None and not any(value == neutral and type(value) is type(neutral) for neutral in table[name]):
        raise ValueError(f"{name} is not supported by this server; leave it out")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class JsonSchemaSpec(_Request):
    """`response_format.json_schema` (OpenAI)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format.json_schema is required when type is "json_schema"')
        return self


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (EBNF)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [k for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar; got "
                             f"{', '.join(given) or 'none'}")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        if self.json_ is not None:
            return {"json_schema": self.json_}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        return {"grammar": self.grammar}


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: Annotated[int, ranged("max_tokens")] | None = None
    temperature: Annotated[float, ranged("temperature")] = 1.0
    top_p: Annotated[float, ranged("top_p")] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, ranged("seed")] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, ranged("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, ranged("frequency_penalty")] = 0.0
    logit_bias: Annotated[dict[str, Annotated[float, ranged("logit_bias")]],
                          Field(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # vLLM extensions
    top_k: Annotated[int, ranged("top_k")] = -1
    ignore_eos: bool = False
    min_tokens: Annotated[int, ranged("min_tokens")] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    repetition_penalty: Annotated[float, ranged("repetition_penalty")] = 1.0
    # Lower runs sooner (needs scheduling_policy "priority" unless 0); None: the key's tenant's default, else 0.
    priority: Annotated[int, Field(ge=-1_000_000, le=1_000_000)] | None = None
    # Not implemented (UNSUPPORTED): a 400 unless neutral.
    min_p: Any = None
    use_beam_search: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    include_stop_str_in_output: Any = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    # Structured outputs (see model/sampling/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator(*UNSUPPORTED, mode="plain")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(UNSUPPORTED, value, info.field_name)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {_short(key)}")
        return bias

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, stop: Any) -> list[str]:
        if stop is not None and not isinstance(stop, (str, list)):
            raise ValueError("must be a string or an array of strings")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) for s in stops):
            raise ValueError("must be a string or an array of strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters long, got {len(s)}")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    def default_max_tokens(self) -> int | None:
        """The completion length when the request gives none (None: the rest of the context)."""
        return None

    def logprobs_count(self) -> int | None:
        """Top-N logprobs per generated token (None: no logprobs)."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """Top-N logprobs per prompt token (None: none)."""
        return None

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """The structured-output constraint as (the field it came from, SamplingParams keyword
        arguments), or None. Raises ValueError, naming the field first, when two fields each ask for one."""
        found: list[tuple[str, dict[str, Any]]] = []
        fmt = None if self._response_format_absorbed else self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema" and fmt.json_schema is not None:
            found.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.sampling_kwargs()))
        found.extend(self._tool_constraint())
        if len(found) > 1:
            raise ValueError(f"{found[1][0]} and {found[0][0]} both constrain the output; give only one")
        return found[0] if found else None

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        return []

    _response_format_absorbed: bool = PrivateAttr(default=False)

    def to_sampling_params(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """Decoding parameters of choice `choice`, generating at most `max_tokens` (the
        serving layer resolves the request's value or the default against the context). A seed
        gives choice i the seed + i.

        Raises ValueError naming the field when a combination is invalid (min_tokens > max_tokens).
        """
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs_count(),
            prompt_logprobs=self.prompt_logprobs_count(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            **(constraint[1] if (constraint := self.constraint()) else {}),
        )


def _short(value: str) -> str:
    return repr(value if len(value) <= 20 else value[:17] + "...")


def _check_prompt(value: Any) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, an array of strings, an array of token ids or an array of such arrays")
    if all(isinstance(p, str) for p in value):
        prompts: list[Prompt] = list(value)
    elif all(_is_token_list(p) for p in value):
        prompts = [list(p) for p in value]
    elif all(_is_token_id(t) for t in value):
        prompts = [list(value)]
    else:
        raise ValueError("must be a string, an array of strings, an array of token ids or an array of such arrays")
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompts)}")
    return prompts


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _is_token_list(p: Any) -> bool:
    return isinstance(p, list) and all(_is_token_id(t) for t in p)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    prompt: Any
    logprobs: Annotated[int, ranged("logprobs")] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # only = n: we return every choice
    suffix: Any = None  # UNSUPPORTED_COMPLETIONS

    @field_validator("prompt", mode="plain")
    @classmethod
    def _validate_prompt(cls, value: Any) -> list[Prompt]:
        return _check_prompt(value)

    @field_validator(*UNSUPPORTED_COMPLETIONS, mode="plain")
    @classmethod
    def _unsupported_here(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(UNSUPPORTED_COMPLETIONS, value, info.field_name)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of must be >= n, got best_of={best_of} and n={n}")
        if best_of is not None and best_of > n:
            raise ValueError(f"best_of > n is not supported by this server (got best_of={best_of}, n={n}): "
                             "it returns every choice it samples, so ask for n choices instead")
        return best_of

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        # echo + logprobs: the echoed prompt carries its logprobs too (as vLLM)
        return self.logprobs if self.echo else None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: Annotated[str, Field(min_length=1)]  # data:image/...;base64, https://, or file:// (service/http/images.py)
    detail: Literal["auto", "low", "high"] = "auto"  # low: scaled to fit 512x512 first, as OpenAI does


class ImagePart(_Request):
    """`{"type": "image_url", "image_url": {"url", "detail"}}`: an image of a user or tool message."""

    type: Literal["image_url"]
    image_url: ImageURL


_PART_MODELS: dict[str, type[_Request]] = {"text": TextPart, "image_url": ImagePart}
_PART_SHAPES = {"text": '{"type": "text", "text": <string>}',
                "image_url": '{"type": "image_url", "image_url": {"url": <string>, "detail": "auto"|"low"|"high"}}'}


class FunctionCall(_Request):
    """`tool_calls[].function` of an assistant message: `arguments` is JSON text (OpenAI) or an
    object; JSON text of an object reaches the chat template as the object transformers'
    templates expect. Other text (a call a client cut short) reaches it as the text it is."""

    name: str
    arguments: str | dict[str, Any]

    @field_validator("arguments", mode="plain")
    @classmethod
    def _json_object(cls, value: Any) -> str | dict[str, Any]:
        if isinstance(value, dict):
            return value
        if not isinstance(value, str):
            raise ValueError("must be a JSON object or its text")
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value


def _a(role: str) -> str:
    return f"an {role}" if role[0] in "aeiou" else f"a {role}"


class ToolCallItem(_Request):
    id: Annotated[str, Field(max_length=256)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# Message fields clients send that say nothing to the model (output-only or empty): accepted and
# left out of the prompt. Any field not declared here or on ChatMessage is a 400 naming it.
_IGNORED_MESSAGE_FIELDS = {"refusal": (None,), "audio": (None,), "function_call": (None,), "annotations": ()}


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallItem], Field(max_length=128)] | None = None  # assistant
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # tool: the call it answers
    reasoning_content: str | None = None  # assistant: its earlier thinking (also as `reasoning`)
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if key in cls.model_fields:
                    continue
                neutral = _IGNORED_MESSAGE_FIELDS.get(key)
                if neutral is None or (neutral and value not in neutral):
                    raise ValueError(f"message field {key!r} is not supported by this server; leave it out")
            data = {k: v for k, v in data.items() if k in cls.model_fields}
        return data

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, content: Any) -> str | list[TextPart | ImagePart] | None:
        # Plain validation keeps union member names out of error locations.
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in _PART_MODELS:
                    raise ValueError(f"part {i} has type {kind!r}; this server takes text and image_url parts")
                try:
                    parts.append(_PART_MODELS[kind].model_validate(part))
                except ValidationError:
                    raise ValueError(f"part {i} must be {_PART_SHAPES[kind]}") from None
            return parts
        raise ValueError("must be a string or an array of text and image_url parts")

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"{_a(self.role)} message must have content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to {_a(self.role)} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not to {_a(self.role)} message")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError(f"reasoning belongs to assistant messages, not to {_a(self.role)} message")
        if self.image_parts() and self.role not in ("user", "tool"):
            raise ValueError(f"image_url parts belong to user and tool messages, not to {_a(self.role)} message")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined, images left out)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """(index in content, part) of each image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, part) for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def _template_content(self) -> str | list[dict[str, Any]] | None:
        """Text parts joined into one string; with images, the parts in order as HF vision templates
        take them (`{"type": "text", "text"}`, and `{"type": "image"}` where the model's placeholder goes)."""
        if not isinstance(self.content, list):
            return self.content
        if not self.image_parts():
            return self.text
        return [{"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.content]

    def template_dict(self) -> dict[str, Any]:
        """The message as transformers' `apply_chat_template` gives it to a template: content a
        string (text parts joined) or, with images, its parts, call arguments as objects, fields
        that are null left out, and the reasoning under all of its names (`thinking` for gpt-oss
        templates)."""
        out: dict[str, Any] = {"role": self.role, "content": self._template_content(),
                               "name": self.name, "tool_call_id": self.tool_call_id,
                               "reasoning_content": self.reasoning_content, "reasoning": self.reasoning}
        if self.tool_calls is not None:
            out["tool_calls"] = [{k: v for k, v in (("id", c.id), ("type", c.type)) if v is not None}
                                 | {"function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        out = {k: v for k, v in out.items() if v is not None}
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        return out


class FunctionSpec(_Request):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: _FunctionName


MAX_TEMPLATE_KWARGS = 32
# Variables the server itself gives the chat template: chat_template_kwargs cannot replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{key!r} is set by the server and cannot be passed to the chat template")
    return kwargs


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, ranged("max_tokens")] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, ranged("logprobs")] | None = None
    add_generation_prompt: bool = True
    # Not implemented (UNSUPPORTED_CHAT): a 400 unless neutral.
    echo: Any = None
    continue_final_message: Any = None
    audio: Any = None
    modalities: Any = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # default: true, as OpenAI
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @field_validator(*UNSUPPORTED_CHAT, mode="plain")
    @classmethod
    def _unsupported_here(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(UNSUPPORTED_CHAT, value, info.field_name)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_kwargs(kwargs)

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        # Plain validation keeps union member names out of error locations.
        if isinstance(choice, dict):
            try:
                choice = NamedToolChoice.model_validate(choice)
            except ValidationError:
                raise ValueError('a named tool_choice must be {"type": "function", "function": {"name": <string>}}'
                                 ) from None
        elif choice is not None and choice not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}')
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                             f"({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs at least one tool in tools')
        return choice

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or the name of the function that must be called ("none"
        without tools; "auto" when tools come without a choice, as OpenAI)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or "auto"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (none when the model may not call them)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def function_tools(self) -> list[dict[str, Any]]:
        """The tools as {"name", "parameters"}."""
        return [{"name": t.function.name, "parameters": t.function.parameters} for t in self.tools or []]

    def use_tool_constraint(self, field: str, kwargs: dict[str, Any], absorbs_response_format: bool) -> None:
        """Constrain the output for its tools (service/tools/answer.py), the request's
        response_format included when `absorbs_response_format`."""
        self._tool_kwargs = (field, kwargs)
        self._response_format_absorbed = absorbs_response_format

    _tool_kwargs: tuple[str, dict[str, Any]] | None = PrivateAttr(default=None)

    def _tool_constraint(self) -> list[tuple[str, dict[str, Any]]]:
        return [self._tool_kwargs] if self._tool_kwargs else []

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    """`POST /tokenize`: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_kwargs(kwargs)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


SAMPLING_PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {
    "max_completion_tokens", "top_logprobs", "response_format", "structured_outputs", "tools", "tool_choice"}
