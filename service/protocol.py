"""Pydantic models of the OpenAI-compatible request bodies: JSON in, `SamplingParams` out.

Unknown fields are ignored (clients send many). Types are strict (a boolean is not "yes",
an integer is not 1.5) and every range is checked here, so a bad field is a 400 naming it.
Response bodies are built in `service/responses.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from model.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request
MAX_STOP = 8  # stop strings
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # length of one stop string
MAX_MESSAGES = 512
MAX_TOP_K = 2**31 - 1  # torch's top-k overflowed past int64 and killed the engine step

Prompt = Union[str, list[int]]

_Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI names plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: _Temperature = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    user: Annotated[str, Field(max_length=256)] | None = None
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_TOP_K)] = -1
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0

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

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """Top-N logprobs per generated token (None: no logprobs)."""
        return None

    def to_sampling_params(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """Decoding parameters of choice `choice`; `default_max_tokens` (what the context
        allows) applies when the request gives none. A seed gives choice i the seed + i.

        Raises ValueError naming the field when a combination is invalid (min_tokens > max_tokens).
        """
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs_count(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )


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
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt", mode="plain")
    @classmethod
    def _validate_prompt(cls, value: Any) -> list[Prompt]:
        return _check_prompt(value)

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt

    def logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="plain")
    @classmethod
    def _check_content(cls, content: Any) -> str | list[TextPart] | None:
        # Plain validation keeps union member names out of error locations.
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list):
            parts = []
            for i, part in enumerate(content):
                try:
                    parts.append(TextPart.model_validate(part))
                except ValidationError:
                    raise ValueError(f'part {i} must be {{"type": "text", "text": <string>}}') from None
            return parts
        raise ValueError("must be a string or an array of text parts")

    @model_validator(mode="after")
    def _needs_content(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message must have content")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

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

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


SAMPLING_PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {"max_completion_tokens", "top_logprobs"}
