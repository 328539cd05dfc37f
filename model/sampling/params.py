"""`SamplingParams`: how one request is decoded (vLLM/OpenAI field names).

Plain dataclass with no torch import, so the scheduler and the HTTP layer can use it.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
# Below this temperature sampling is greedy: logits / temperature would overflow float32
# (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
MAX_INT64 = 2**63 - 1  # seeds and top_k become int64 tensors
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI and vLLM


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric parameter: [lo, hi], or (lo, hi] with `lo_open`."""

    lo: float | None
    hi: float | None
    allowed: str  # how error messages state the range
    lo_open: bool = False
    integer: bool = False

    def check(self, name: str, value: object) -> None:
        """Raise ValueError naming `name`, the value and the range unless `value` is allowed."""
        kind = numbers.Integral if self.integer else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{name} must be {'an integer' if self.integer else 'a number'} {self.allowed}, "
                             f"got {value!r}")
        lo_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        # NaN compares false with everything, so it fails here too.
        if not (lo_ok and (self.hi is None or value <= self.hi) and value == value):
            raise ValueError(f"{name} must be {self.allowed}, got {value!r}")


# The one declaration of each parameter's range: `SamplingParams` checks against it and the HTTP
# request models (service/openai/protocol.py) build their field constraints from it.
PARAM_RANGES: dict[str, Range] = {
    "max_tokens": Range(1, None, ">= 1", integer=True),
    "temperature": Range(0.0, 2.0, "in [0, 2]"),
    "top_p": Range(0.0, 1.0, "in (0, 1]", lo_open=True),
    "top_k": Range(-1, MAX_INT64, "-1 (disabled), 0 (disabled) or >= 1 (at most 2**63 - 1)", integer=True),
    "seed": Range(0, MAX_INT64, "in [0, 2**63 - 1]", integer=True),
    "min_tokens": Range(0, None, ">= 0", integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]", integer=True),
    "presence_penalty": Range(-2.0, 2.0, "in [-2, 2]"),
    "frequency_penalty": Range(-2.0, 2.0, "in [-2, 2]"),
    "repetition_penalty": Range(0.0, 2.0, "in (0, 2]", lo_open=True),
    "logit_bias": Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
}
_SCALARS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty",
            "frequency_penalty", "repetition_penalty")
_OPTIONAL = frozenset({"seed", "logprobs"})  # None: not set


STRUCTURED_FIELDS = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredSpec:
    """One structured-output constraint as text: what `model/sampling/structured.py` compiles and
    caches. `kind` is "json" (a JSON schema), "json_object", "regex", "choice" (a JSON
    array of the allowed strings), "grammar" (EBNF) or "structural_tag" (xgrammar's structural
    tag, JSON: free text that switches to a constrained format after a trigger, as tool calls do)."""

    kind: str
    text: str


@dataclass
class SamplingParams:
    """Decoding parameters of one request. `temperature=0` (or below 1e-5) is greedy.

    Bad values raise `ValueError` naming the field, the value and the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (vLLM); the prompt is then never
    # served from the prefix cache, so that every position is computed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # Structured outputs (at most one): the output is constrained while decoding to a JSON
    # schema (dict or JSON text), a regex (full match), one of `choice`, an EBNF grammar, or
    # any JSON object. Checked for syntax when the engine compiles them (ValueError).
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = None
    # An attention request (model.inspect.attention_spec.AttentionSpec): when it finishes, the engine
    # returns the per-head attention weights of its tokens with the output.
    attention: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self._validate()

    def _validate(self) -> None:
        for name in _SCALARS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                PARAM_RANGES[name].check(name, value)
        if self.prompt_logprobs is not None:
            PARAM_RANGES["logprobs"].check("prompt_logprobs", self.prompt_logprobs)
        Range(0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]", integer=True).check(
            "min_tokens", self.min_tokens)
        for token_id, bias in self.logit_bias.items():
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            PARAM_RANGES["logit_bias"].check(f"logit_bias[{token_id}]", bias)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self._validate_structured()

    def _validate_structured(self) -> None:
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give at most one structured-output constraint, got {', '.join(given)}")
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                raise ValueError(f"{name} must be a dict or a JSON string, got {type(value).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a boolean, got {self.json_object!r}")

    @property
    def structured(self) -> StructuredSpec | None:
        """The structured-output constraint, if any, in its canonical text form."""
        if self.json_schema is not None:
            # Key order is kept: properties are generated in the schema's order.
            text = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            return StructuredSpec("json", text)
        if self.regex is not None:
            return StructuredSpec("regex", self.regex)
        if self.choice is not None:
            return StructuredSpec("choice", json.dumps(list(self.choice), ensure_ascii=False))
        if self.grammar is not None:
            return StructuredSpec("grammar", self.grammar)
        if self.json_object:
            return StructuredSpec("json_object", "")
        if self.structural_tag is not None:
            tag = self.structural_tag
            return StructuredSpec("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
