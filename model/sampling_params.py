"""`SamplingParams`: how one request is decoded (vLLM/OpenAI field names).

Plain dataclass with no torch import, so the scheduler and the HTTP layer can use it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# Below this temperature sampling is greedy: logits / temperature would overflow float32
# (vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


def _check_range(name: str, value: float, lo: float | None, hi: float | None, allowed: str,
                 integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'} {allowed}, got {value!r}")
    # NaN compares false with everything: reject it explicitly.
    if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check_range("max_tokens", self.max_tokens, 1, None, ">= 1", integer=True)
        _check_range("temperature", self.temperature, 0.0, 2.0, "in [0, 2]")
        _check_range("top_p", self.top_p, 1e-9, 1.0, "in (0, 1]")
        _check_range("top_k", self.top_k, -1, None, "-1 (disabled), 0 (disabled) or >= 1", integer=True)
        if self.seed is not None:
            _check_range("seed", self.seed, 0, 2**63 - 1, "in [0, 2**63 - 1]", integer=True)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]",
                     integer=True)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]", integer=True)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_range("repetition_penalty", self.repetition_penalty, 1e-6, 2.0, "in (0, 2]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
