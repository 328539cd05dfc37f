"""The checks of one request against the model it runs on, in one place: `Engine.add_request`
and the HTTP edge (service/openai/serving.py) both call `check_request`, so the two never drift.

Torch-free. Each failure is a `RequestError` (a `ValueError`) naming the parameter at fault.
Ranges of single parameters are `SamplingParams`'s business (model/sampling/params.py); this
module checks what needs the model: the vocabulary and the context length.
"""

from __future__ import annotations

from collections.abc import Iterable

from model.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request the model cannot run; `param` names the request field at fault."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """At least one token, every id in [0, vocab_size)."""
    if not token_ids:
        raise RequestError(f"{param} must not be empty: it needs at least one token", param)
    _check_in_vocab(token_ids, vocab_size, param)


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """The prompt plus the completion must fit the context (OpenAI's message)."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or the completion.", param, "context_length_exceeded")


def check_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  param: str = "prompt") -> None:
    """Everything about one request that depends on the model: prompt ids, ids named in the
    sampling parameters (stop_token_ids, logit_bias), and the context length."""
    check_token_ids(prompt_token_ids, vocab_size, param)
    # An id past the vocabulary would index outside the logits inside the step (min_tokens
    # suppresses stop ids, logit_bias adds to them) and fail the whole batch.
    _check_in_vocab(params.stop_token_ids, vocab_size, "stop_token_ids")
    _check_in_vocab(params.logit_bias, vocab_size, "logit_bias")
    check_context(len(prompt_token_ids), params.max_tokens, max_model_len, param)


def _check_in_vocab(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} in {param} is outside the vocabulary: allowed 0..{vocab_size - 1}",
                           param)
