"""The offline API as a user sees it: `LLM(model, device, dtype).generate(prompts, params)`.

The random-weight presets mostly repeat the prompt's last token when greedy, so the tests that
need varied text use a tiny random GPT-2 checkpoint with a BPE tokenizer (multi-character
tokens), and build stop strings and stop ids from what the model actually generates.
"""

from __future__ import annotations

import math

import pytest
import torch

from model import LLM, PRESETS, SamplingParams
from model.config import BYTE_EOS_ID, EngineConfig
from model.loading.loading import build_preset
from tests.support.tiny_models import full_logits, save_tiny_gpt2

BASE = "transformer-base"
ENGINE = EngineConfig(kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def base() -> LLM:
    return LLM(BASE, engine_config=ENGINE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    directory = save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))
    # CPU float32 on every machine: logprobs are compared with a reference forward pass.
    return LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(kv_cache_memory_bytes=8 << 20))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


# ---- prompts, params, order -----------------------------------------------------------


def test_string_and_token_id_prompts_give_the_same_output(base: LLM) -> None:
    outs = base.generate(["The cat", list(b"The cat")], greedy(3))
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == list(b"The cat")
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 3
    assert outs[0].text == outs[1].text == base.tokenizer.decode(outs[0].token_ids)
    # A single prompt, string or token ids, is a batch of one.
    for single in ("The cat", list(b"The cat")):
        (out,) = base.generate(single, greedy(3))
        assert out.token_ids == outs[0].token_ids


def test_one_params_for_all_or_one_per_prompt(tiny: LLM) -> None:
    prompts = ["The cat", "Hello", "She sells"]
    shared = tiny.generate(prompts, greedy(4, ignore_eos=True))
    assert [len(o.token_ids) for o in shared] == [4, 4, 4]
    per_prompt = tiny.generate(prompts, [greedy(2, ignore_eos=True), greedy(5, ignore_eos=True),
                                         greedy(3, ignore_eos=True)])
    assert [len(o.token_ids) for o in per_prompt] == [2, 5, 3]
    for a, b in zip(per_prompt, shared):  # greedy: one is a prefix of the other
        n = min(len(a.token_ids), len(b.token_ids))
        assert a.token_ids[:n] == b.token_ids[:n]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        tiny.generate(prompts, [greedy(2), greedy(2)])


def test_outputs_come_in_prompt_order_and_equal_each_prompt_alone(tiny: LLM) -> None:
    prompts = ["The cat", "Hello, world", "She sells", "Attention", "0123", "In the"]
    params = [SamplingParams(max_tokens=3 + i, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    batch = tiny.generate(prompts, params)
    alone = [tiny.generate(p, sp)[0] for p, sp in zip(prompts, params)]
    assert [o.prompt_token_ids for o in batch] == [tiny.tokenizer.encode(p) for p in prompts]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]
    assert [o.text for o in batch] == [o.text for o in alone]
    assert len({tuple(o.token_ids[:3]) for o in batch}) > 1, "the prompts should not all generate the same"


def test_a_bad_prompt_raises_and_the_llm_keeps_working(base: LLM) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        base.generate(["The cat", [1, 2, 100_000]], greedy(2))
    with pytest.raises(ValueError, match="at least one token"):
        base.generate(["The cat", ""], greedy(2))
    (out,) = base.generate("abc", greedy(2))
    assert out.token_ids == list(b"cc") and out.finish_reason == "length"


# ---- finish reasons -------------------------------------------------------------------


def test_length_gives_exactly_max_tokens(tiny: LLM) -> None:
    for n in (1, 7):
        (out,) = tiny.generate("The cat", SamplingParams(max_tokens=n, seed=3, ignore_eos=True))
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"
        assert out.text == tiny.tokenizer.decode(out.token_ids)


def _stop_string_across_tokens(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A stop string that starts inside one generated token and ends inside a later one, and
    how many tokens are generated when it first completes."""
    pieces = [tokenizer.decode([t]) for t in token_ids]
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        if len(a) >= 2 and b and "\ufffd" not in a + b:
            stop = a[1:] + b[0]
            for n in range(1, len(token_ids) + 1):
                if stop in tokenizer.decode(token_ids[:n]):
                    return stop, n
    raise AssertionError(f"no two printable adjacent tokens in {pieces!r}")


@pytest.mark.parametrize("prompt", ["Hello, world", "The cat"])
def test_stop_string_spanning_tokens_cuts_the_text_before_it(tiny: LLM, prompt: str) -> None:
    (full,) = tiny.generate(prompt, greedy(24, ignore_eos=True))
    stop, n = _stop_string_across_tokens(tiny.tokenizer, full.token_ids)
    (out,) = tiny.generate(prompt, greedy(24, ignore_eos=True, stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[:n]  # generation ends with the token that completes it


def test_the_earliest_of_several_stop_strings_wins(tiny: LLM) -> None:
    params = SamplingParams(max_tokens=24, seed=1, ignore_eos=True)
    (full,) = tiny.generate("The cat", params)
    text = full.text
    early, late = text[3:5], text[12:15]
    assert text.index(early) < text.index(late)
    (out,) = tiny.generate("The cat", SamplingParams(max_tokens=24, seed=1, ignore_eos=True, stop=[late, early]))
    assert out.finish_reason == "stop"
    assert out.text == text[:text.index(early)]


def test_stop_token_ids_end_generation_without_their_text(tiny: LLM) -> None:
    params = SamplingParams(max_tokens=16, seed=7, ignore_eos=True)
    (full,) = tiny.generate("She sells", params)
    k = next(i for i in range(2, len(full.token_ids)) if full.token_ids[i] not in full.token_ids[:i])
    stop_id = full.token_ids[k]
    (out,) = tiny.generate("She sells", SamplingParams(max_tokens=16, seed=7, ignore_eos=True,
                                                       stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:k + 1]
    assert out.text == tiny.tokenizer.decode(full.token_ids[:k])


# The presets tend to repeat the prompt's last token: a prompt ending in <eos> generates <eos>.
EOS_PROMPT = list(b"ab") + [BYTE_EOS_ID]


def test_eos_stops_generation_unless_ignore_eos(base: LLM) -> None:
    (ignored,) = base.generate([EOS_PROMPT], greedy(4, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 4
    assert BYTE_EOS_ID in ignored.token_ids, "precondition: the model generates <eos> for this prompt"
    k = ignored.token_ids.index(BYTE_EOS_ID)
    (out,) = base.generate([EOS_PROMPT], greedy(4))
    assert out.finish_reason == "stop"
    assert out.token_ids == ignored.token_ids[:k + 1]
    assert out.text == base.tokenizer.decode(ignored.token_ids[:k])


def test_min_tokens_suppresses_eos_and_stop_token_ids(base: LLM) -> None:
    (out,) = base.generate([EOS_PROMPT], greedy(5, min_tokens=3))
    assert len(out.token_ids) >= 3
    assert BYTE_EOS_ID not in out.token_ids[:3]
    stop_id = base.generate("The cat", greedy(1))[0].token_ids[0]
    (plain,) = base.generate("The cat", greedy(5, stop_token_ids=[stop_id]))
    assert plain.token_ids == [stop_id] and plain.finish_reason == "stop"
    (held,) = base.generate("The cat", greedy(5, stop_token_ids=[stop_id], min_tokens=2))
    assert len(held.token_ids) >= 2
    assert stop_id not in held.token_ids[:2]


# ---- logprobs -------------------------------------------------------------------------


def test_logprobs_give_the_top_n_and_the_chosen_tokens_logprob(tiny: LLM) -> None:
    prompt = tiny.tokenizer.encode("Hello, world")
    (out,) = tiny.generate([prompt], greedy(6, ignore_eos=True, logprobs=3))
    assert len(out.logprobs) == len(out.token_ids) == 6
    net = tiny.engine.runner.model
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.top[0] == (tok, pytest.approx(lp.logprob))  # greedy: the best is the chosen token
        # The same numbers as the model's own next-token distribution over the whole sequence.
        ref = torch.log_softmax(full_logits(net, prompt + out.token_ids[:j])[-1].double(), dim=-1)
        assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
        assert [i for i, _ in lp.top] == ref.topk(3).indices.tolist()
    assert sum(math.exp(v) for _, v in out.logprobs[0].top) < 1.0


def test_logprobs_of_sampled_tokens_and_zero_top(tiny: LLM) -> None:
    (out,) = tiny.generate("The cat", SamplingParams(max_tokens=8, seed=5, ignore_eos=True, logprobs=5))
    assert any(lp.top[0][0] != lp.token_id for lp in out.logprobs), "a sampled token is not always the best"
    for lp in out.logprobs:
        top = dict(lp.top)
        assert lp.logprob <= lp.top[0][1] + 1e-6
        if lp.token_id in top:
            assert top[lp.token_id] == pytest.approx(lp.logprob)
    (zero,) = tiny.generate("The cat", SamplingParams(max_tokens=3, seed=5, ignore_eos=True, logprobs=0))
    assert [lp.top for lp in zero.logprobs] == [[], [], []]
    assert [lp.logprob for lp in zero.logprobs] == pytest.approx([lp.logprob for lp in out.logprobs[:3]])
    (none,) = tiny.generate("The cat", SamplingParams(max_tokens=3, seed=5, ignore_eos=True))
    assert none.logprobs is None and none.token_ids == out.token_ids[:3]


# ---- devices and dtypes ---------------------------------------------------------------


def test_auto_device_and_dtype(base: LLM) -> None:
    cuda = torch.cuda.is_available()
    assert base.engine.runtime.device.startswith("cuda" if cuda else "cpu")
    assert base.engine.runtime.dtype == ("bfloat16" if cuda else "float32")
    assert next(base.engine.runner.model.parameters()).dtype == (torch.bfloat16 if cuda else torch.float32)


def test_bfloat16_runs_and_agrees_with_float32(base: LLM) -> None:
    prompts = ["The cat", "Hello, world", "abc", "Once upon a time"]
    params = greedy(2, logprobs=2)
    bf16 = LLM(BASE, dtype="bfloat16", engine_config=ENGINE)
    assert bf16.engine.runtime.dtype == "bfloat16"
    assert next(bf16.engine.runner.model.parameters()).dtype == torch.bfloat16
    f32 = LLM(BASE, dtype="float32", engine_config=ENGINE).generate(prompts, params)
    for a, b in zip(f32, bf16.generate(prompts, params)):
        assert b.token_ids[0] == a.token_ids[0]
        assert all(math.isfinite(v) for lp in b.logprobs for _, v in lp.top)
        assert b.logprobs[0].top[1][1] == pytest.approx(a.logprobs[0].top[1][1], abs=0.5)


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "tpu"}, "device must be auto, cpu, cuda or cuda:N; got 'tpu'"),
    ({"device": "mps"}, "device must be auto, cpu, cuda or cuda:N; got 'mps'"),
    ({"device": "cuda"}, "CUDA is not available"),
    ({"dtype": "float64"}, "dtype must be one of auto, float32, float16, bfloat16"),
    ({"dtype": "fp32"}, "'fp32'"),
])
def test_bad_device_or_dtype_is_a_clear_value_error(kwargs, match) -> None:
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match=match):
        LLM(BASE, engine_config=ENGINE, **kwargs)


def test_unknown_model_lists_the_presets() -> None:
    with pytest.raises(ValueError, match="no-such-model") as err:
        LLM("no-such-model", engine_config=ENGINE)
    for name in PRESETS:
        assert name in str(err.value)


# ---- presets --------------------------------------------------------------------------


def test_a_preset_is_the_same_model_on_every_construction(base: LLM) -> None:
    torch.manual_seed(12345)
    torch.rand(1000)  # the global RNG state must not matter
    other = LLM(BASE, seed=7, engine_config=ENGINE)
    mine, theirs = base.engine.runner.model.state_dict(), other.engine.runner.model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    params = greedy(2, logprobs=4)
    for a, b in zip(base.generate(["Hello", "xyz"], params), other.generate(["Hello", "xyz"], params)):
        assert a.token_ids == b.token_ids
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]


def test_transformer_base_is_the_papers_base_model() -> None:
    cfg = PRESETS[BASE]
    assert (cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff, cfg.n_layers) == (512, 8, 64, 2048, 6)
    assert cfg.attention == "dot" and cfg.activation == "relu"
    assert not cfg.learned_positions and not cfg.pre_norm
    assert cfg.vocab_size == 258  # 256 bytes, <eos>, <pad>
    assert PRESETS["transformer-base-additive"] == cfg.replace(attention="additive")
    net = build_preset(BASE)
    d, ff, n = 512, 2048, 6
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * 2 * d
    # Token embedding shared with the output layer; sinusoidal positions have no parameters.
    assert sum(p.numel() for p in net.parameters()) == 258 * d + n * per_layer == 19_046_400
    assert not any("wpe" in name for name, _ in net.named_parameters())
    pos = torch.arange(50, dtype=torch.float64)[:, None]
    i = torch.arange(0, d, 2, dtype=torch.float64)
    assert torch.allclose(net.pe[:50, 0::2].double(), torch.sin(pos / 10000 ** (i / d)), atol=1e-6)
    assert torch.allclose(net.pe[:50, 1::2].double(), torch.cos(pos / 10000 ** (i / d)), atol=1e-6)
