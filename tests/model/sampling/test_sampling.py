"""SamplingParams validation and the batched sampler: seeds, temperature, top-k, top-p and
penalties, checked on fixed logits through `model.sampling.sampler.sample` and end to end through `LLM`."""

from __future__ import annotations

import math
import re

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.sampling.sampler import SamplingRow, _top_k_top_p, apply_penalties, sample
from tests.support.tiny_models import save_tiny_gpt2

NAN = float("nan")


# ---- SamplingParams validation --------------------------------------------------------

BAD_VALUES = [
    # field, value, the allowed range the message must state
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", -3, ">= 1"),
    ("max_tokens", 2.5, ">= 1"),
    ("max_tokens", True, ">= 1"),
    ("temperature", -0.1, "[0, 2]"),
    ("temperature", 2.5, "[0, 2]"),
    ("temperature", NAN, "[0, 2]"),
    ("temperature", "hot", "[0, 2]"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", NAN, "(0, 1]"),
    ("top_k", -2, ">= 1"),
    ("top_k", 2.5, ">= 1"),
    ("top_k", 2**63, "at most 2**63 - 1"),
    ("seed", -1, "[0, 2**63 - 1]"),
    ("seed", 2**63, "[0, 2**63 - 1]"),
    ("seed", 1.5, "[0, 2**63 - 1]"),
    ("min_tokens", -1, "[0, max_tokens=16]"),
    ("min_tokens", 17, "[0, max_tokens=16]"),
    ("logprobs", -1, "[0, 20]"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", 2.5, "[0, 20]"),
    ("presence_penalty", -2.5, "[-2, 2]"),
    ("presence_penalty", 2.01, "[-2, 2]"),
    ("presence_penalty", NAN, "[-2, 2]"),
    ("frequency_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -2.01, "[-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 2]"),
    ("repetition_penalty", 2.5, "(0, 2]"),
    ("stop", [""], "non-empty strings"),
    ("stop", ["ok", 3], "non-empty strings"),
    ("stop_token_ids", [-1], "non-negative integers"),
    ("stop_token_ids", [1.5], "non-negative integers"),
]


@pytest.mark.parametrize("field, value, allowed", BAD_VALUES)
def test_bad_values_are_value_errors_naming_field_value_and_range(field, value, allowed) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    msg = str(err.value)
    assert msg.startswith(field), msg
    assert repr(value) in msg, msg
    assert allowed in msg, msg


@pytest.mark.parametrize("bias, words", [
    ({5: 100.5}, "logit_bias[5] must be in [-100, 100], got 100.5"),
    ({5: NAN}, "logit_bias[5] must be in [-100, 100], got nan"),
    ({5: "up"}, "logit_bias[5] must be a number"),
    ({-1: 1.0}, "logit_bias keys must be non-negative token ids, got -1"),
])
def test_bad_logit_bias_is_a_value_error_naming_the_token(bias, words) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 1}, {"temperature": 0}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_p": 1e-6},
    {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"seed": 0}, {"seed": 2**63 - 1},
    {"min_tokens": 16}, {"logprobs": 0}, {"logprobs": 20}, {"presence_penalty": -2.0},
    {"frequency_penalty": 2}, {"repetition_penalty": 2.0}, {"stop_token_ids": [0]},
    {"logit_bias": {0: -100, 7: 100.0}},
])
def test_edge_values_are_accepted(kwargs) -> None:
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


# ---- the sampler on fixed logits ------------------------------------------------------

VOCAB_PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
LOGITS = VOCAB_PROBS.log() + 1.7  # softmax(LOGITS) == VOCAB_PROBS; the shift must not matter


def row(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        suppress: list[int] | None = None) -> SamplingRow:
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingRow(params, prompt or [], output or [], gen, suppress or [])


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n tokens from one request's generator (or the global RNG), one step at a time."""
    r = row(params)
    return [sample(logits[None].clone(), [r])[0][0] for _ in range(n)]


def counts_of(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Sample n times at once (a batch of n identical rows) and count each token."""
    torch.manual_seed(0)
    tokens, _ = sample(logits.expand(n, -1).clone(), [row(params) for _ in range(n)])
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0])


def assert_follows(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Every count within 5 binomial standard deviations (plus one) of n * p."""
    n = int(counts.sum())
    for tok, (c, p) in enumerate(zip(counts.tolist(), probs.tolist())):
        bound = 5 * math.sqrt(n * p * (1 - p)) + 1
        assert abs(c - n * p) <= bound, f"token {tok}: {c} draws, expected {n * p:.0f} +- {bound:.0f}"


def test_the_same_seed_gives_the_same_samples_and_different_seeds_differ() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))
    a = draws(logits, SamplingParams(seed=42), 30)
    assert a == draws(logits, SamplingParams(seed=42), 30)
    assert a != draws(logits, SamplingParams(seed=43), 30)
    assert len(set(a)) > 3  # really sampled


def test_a_seeded_row_samples_the_same_whatever_else_is_in_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 300
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3),
              SamplingParams(top_k=5, seed=7), SamplingParams(top_p=0.5, temperature=0.7),
              SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3, seed=9),
              SamplingParams(temperature=2.0, top_k=50, top_p=0.9, logprobs=3)]
    steps = [torch.randn(len(others) + 1, vocab, generator=gen) * 3 for _ in range(12)]
    alone_row, alone = row(target), []
    for logits in steps:
        alone.append(sample(logits[:1].clone(), [alone_row])[0][0])
    for position in (0, 3, len(others)):
        batch = [row(p, output=[1, 2, 2]) for p in others]
        batch.insert(position, row(target))
        got = []
        for logits in steps:
            # The target's logits are the same each step; its neighbours' are not.
            mixed = torch.cat([logits[1:position + 1], logits[:1], logits[position + 1:]])
            got.append(sample(mixed.clone(), batch)[0][position])
        assert got == alone, f"target at position {position}"
    assert len(set(alone)) > 3


def test_an_unrestricted_row_keeps_its_whole_distribution_beside_a_top_k_row() -> None:
    # A peaked row whose float32 cumulative probability reaches 1.0 long before its tail ends:
    # top_p=1 must not cut that tail just because another row of the batch uses top-k.
    logits = torch.cat([torch.zeros(1), torch.full((99_999,), -17.0)])
    kept = _top_k_top_p(torch.stack([logits, logits]), torch.tensor([100_000, 2]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(kept[0]).all(), "a row without top-k/top-p lost tokens in a mixed batch"
    assert torch.isfinite(kept[1]).sum() == 2


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-3, seed=3),
    SamplingParams(temperature=1e-39, seed=3),  # below float32's range once divided into
    SamplingParams(top_k=1, seed=3),
    SamplingParams(top_p=1e-6, seed=3),
    SamplingParams(top_k=1, temperature=2.0),
])
def test_near_zero_temperature_top_k_1_and_tiny_top_p_are_greedy(params) -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2)) * 2
    tokens, _ = sample(logits.clone(), [row(params) for _ in range(16)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_temperature_1_follows_the_softmax() -> None:
    counts = counts_of(LOGITS, SamplingParams(temperature=1.0), 4000)
    assert_follows(counts, VOCAB_PROBS)


def test_temperature_scales_the_logits() -> None:
    counts = counts_of(LOGITS, SamplingParams(temperature=0.5), 4000)
    assert_follows(counts, torch.softmax(LOGITS / 0.5, dim=-1))  # p^2, renormalised
    counts = counts_of(LOGITS, SamplingParams(temperature=2.0), 4000)
    assert_follows(counts, torch.softmax(LOGITS / 2.0, dim=-1))


@pytest.mark.parametrize("params, support", [
    (SamplingParams(top_k=3), [0, 1, 2]),
    (SamplingParams(top_k=1, temperature=2.0), [0]),
    # Nucleus: the smallest set whose mass reaches top_p (0.3 + 0.2 + 0.15 >= 0.6).
    (SamplingParams(top_p=0.6), [0, 1, 2]),
    (SamplingParams(top_p=0.5), [0, 1]),
    (SamplingParams(top_p=0.51), [0, 1, 2]),
    # top-p applies to the distribution top-k left (vLLM and HF order): 0.3/0.5 >= 0.55.
    (SamplingParams(top_k=2, top_p=0.55), [0]),
    (SamplingParams(top_k=4, top_p=0.9), [0, 1, 2, 3]),
])
def test_top_k_and_top_p_restrict_the_support_and_renormalise(params, support) -> None:
    counts = counts_of(LOGITS, params, 3000)
    allowed = torch.zeros_like(VOCAB_PROBS)
    allowed[support] = VOCAB_PROBS[support]
    assert set(torch.nonzero(counts).view(-1).tolist()) == set(support)
    assert_follows(counts, allowed / allowed.sum())


def test_suppressed_ids_are_never_sampled() -> None:
    r = SamplingRow(SamplingParams(temperature=1.0), [], [], None, [0, 1])
    torch.manual_seed(0)
    tokens, _ = sample(LOGITS.expand(500, -1).clone(), [r] * 500)
    assert not {0, 1} & set(tokens)
    assert sample(LOGITS[None].clone(), [SamplingRow(SamplingParams(temperature=0), [], [], None, [0])])[0] == [1]


# ---- penalties ------------------------------------------------------------------------


def test_presence_and_frequency_penalties_follow_openai() -> None:
    # mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c over generated tokens
    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0, 0.0]])
    r = row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[4, 4, 0], output=[1, 3, 3, 3])
    got = apply_penalties(logits.clone(), [r])
    want = torch.tensor([[1.0, -2.0 - 0.25 - 0.5, 0.5, 3.0 - 3 * 0.25 - 0.5, 0.0]])  # prompt tokens untouched
    assert torch.allclose(got, want)
    neg = apply_penalties(logits.clone(), [row(SamplingParams(presence_penalty=-1.0), output=[2])])
    assert torch.allclose(neg, torch.tensor([[1.0, -2.0, 1.5, 3.0, 0.0]]))  # negative encourages


def test_repetition_penalty_follows_vllm() -> None:
    # Tokens seen in the prompt or the output: positive logits divided, negative multiplied.
    logits = torch.tensor([[2.0, -2.0, 0.5, 3.0, -1.0]])
    r = row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[1, 4])
    got = apply_penalties(logits.clone(), [r])
    assert torch.allclose(got, torch.tensor([[1.0, -4.0, 0.5, 3.0, -2.0]]))
    both = row(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), prompt=[0], output=[0, 3])
    # Repetition first, then frequency: 2/2 - 1 and 3/2 - 1.
    assert torch.allclose(apply_penalties(logits.clone(), [both]), torch.tensor([[0.0, -2.0, 0.5, 0.5, -1.0]]))


def test_penalties_apply_per_row() -> None:
    logits = torch.zeros(3, 4)
    rows = [row(SamplingParams(frequency_penalty=1.0), output=[0, 0]), row(SamplingParams()),
            row(SamplingParams(presence_penalty=2.0), output=[3])]
    got = apply_penalties(logits, rows)
    assert torch.equal(got, torch.tensor([[-2.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, -2.0]]))


def test_logit_bias_shifts_the_logits_of_its_row_only() -> None:
    # bias 1.0 on token 0 and -100 on token 7 of row 0: softmax follows the shifted logits there.
    biased = row(SamplingParams(temperature=1.0, logit_bias={0: 1.0, 7: -100}))
    shifted = LOGITS.clone()
    shifted[0] += 1.0
    shifted[7] -= 100
    counts = counts_of(LOGITS, biased.params, 4000)
    assert counts[7] == 0
    assert_follows(counts, torch.softmax(shifted, dim=-1))
    # Greedy rows follow the bias too; an unbiased row beside it does not move.
    rows = [row(SamplingParams(temperature=0, logit_bias={5: 100})), row(SamplingParams(temperature=0))]
    tokens, _ = sample(LOGITS.expand(2, -1).clone(), rows)
    assert tokens == [5, 0]


# ---- end to end through LLM -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    directory = save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))
    return LLM(str(directory), engine_config=EngineConfig(kv_cache_memory_bytes=8 << 20))


def test_a_seeded_request_is_the_same_alone_and_in_a_mixed_batch(tiny: LLM) -> None:
    needle = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=2024, ignore_eos=True)
    (alone,) = tiny.generate("The cat", needle)
    others = ["Hello", "She sells sea shells", "0123456789", "A", "In the beginning there was"]
    params = [SamplingParams(max_tokens=5 + i, temperature=[0.0, 1.0, 1.5][i % 3], top_k=[-1, 20][i % 2],
                             frequency_penalty=0.5 * (i % 2), seed=i if i % 2 else None, ignore_eos=True)
              for i in range(len(others))]
    outs = tiny.generate(others[:2] + ["The cat"] + others[2:], params[:2] + [needle] + params[2:])
    assert outs[2].token_ids == alone.token_ids
    assert outs[2].text == alone.text
    (other_seed,) = tiny.generate("The cat", SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=2025,
                                                             ignore_eos=True))
    assert other_seed.token_ids != alone.token_ids


def test_frequency_penalty_breaks_greedy_repetition(tiny: LLM) -> None:
    (plain,) = tiny.generate("Hello, world", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert len(set(plain.token_ids)) <= 3, "precondition: greedy output repeats itself"
    (penalised,) = tiny.generate("Hello, world", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                                frequency_penalty=2.0))
    assert max(penalised.token_ids.count(t) for t in penalised.token_ids) <= 3


def test_logit_bias_steers_generation(tiny: LLM) -> None:
    (plain,) = tiny.generate("The cat", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    target = next(t for t in range(10, 100) if t not in plain.token_ids)
    (biased,) = tiny.generate("The cat", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        logit_bias={target: 100}))
    assert biased.token_ids == [target] * 6
    banned = plain.token_ids[0]
    (banned_out,) = tiny.generate("The cat", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                            logit_bias={banned: -100}))
    assert banned not in banned_out.token_ids


def test_a_huge_top_k_keeps_every_token_and_does_not_overflow() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=2**63 - 1, seed=3), [1], [],
                      torch.Generator().manual_seed(3), [])
    seen = {sample(logits, [row])[0][0] for _ in range(200)}
    assert seen == {0, 1, 2}
