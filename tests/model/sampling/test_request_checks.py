"""model/sampling/request_checks.py: the one request check the engine and the HTTP edge share. Torch-free."""

from __future__ import annotations

import pytest

from model.sampling.params import SamplingParams
from model.sampling.request_checks import RequestError, check_request

VOCAB = 100
MAX_LEN = 64


@pytest.mark.parametrize("prompt, params, param, words", [
    ([], SamplingParams(), "prompt", "prompt must not be empty"),
    ([1, 100], SamplingParams(), "prompt", "token id 100 in prompt is outside the vocabulary: allowed 0..99"),
    ([-1], SamplingParams(), "prompt", "token id -1 in prompt"),
    ([1], SamplingParams(stop_token_ids=[5, 100]), "stop_token_ids", "token id 100 in stop_token_ids"),
    ([1], SamplingParams(logit_bias={3: 1.0, 250: -1.0}), "logit_bias", "token id 250 in logit_bias"),
    ([1] * 60, SamplingParams(max_tokens=5), "prompt",
     "This model's maximum context length is 64 tokens. However, you requested 65 tokens (60 in the prompt, "
     "5 in the completion). Please reduce the length of the prompt or the completion."),
])
def test_bad_requests_raise_naming_the_parameter(prompt, params, param, words) -> None:
    with pytest.raises(RequestError) as err:
        check_request(prompt, params, VOCAB, MAX_LEN)
    assert err.value.param == param
    assert words in str(err.value)
    assert isinstance(err.value, ValueError)


def test_a_request_that_fits_passes() -> None:  # that it needs no torch: tests/test_layering.py
    check_request([1] * 48, SamplingParams(max_tokens=16, stop_token_ids=[99], logit_bias={0: 5}), VOCAB, MAX_LEN)
