"""RoPE scalings against HF transformers: YaRN (with and without mscale, truncated and not),
dynamic NTK and LongRoPE on tiny Llama checkpoints, each past the original context.

YaRN's frequencies are fixed: a full forward over 100 positions matches HF's. Dynamic and
LongRoPE depend on the sequence length in HF (per forward); here on each token's position
(model/layers/positions.py): a forward within the original context matches HF's, and past it
our logits at each generated position match the logits of HF's own `generate` step by step,
and the greedy continuation is HF's, alone, from the prefix cache, in a batch and preempted.
A prompt already longer than the original context is rotated throughout as HF's prefill of it
is (LongRoPE: long factors; dynamic NTK: the base of the prompt's length).
"""

from __future__ import annotations

import pytest
import torch

from model.loading.checkpoint import CheckpointError, load_model
from tests.support.tiny_models import one_thread  # noqa: F401  (autouse: this module runs on one torch thread)
from tests.support.tiny_models import engine_greedy_runs, full_logits, write_tiny_llama
from tests.support.requirements import need_module

transformers = need_module("transformers")

LOGITS_ATOL = 1e-4
GREEDY = 32
HEAD_HALF = 8  # head_dim 16: 8 frequencies
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
YARN_MSCALE = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.707,
               "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(HEAD_HALF)],
            "long_factor": [1.5 + 0.7 * i for i in range(HEAD_HALF)]}
# id -> (rope parameters, max_position_embeddings, where HF's frequencies switch or None)
CASES = {
    "yarn": (YARN, 128, None),
    "yarn-mscale-untruncated": (YARN_MSCALE, 128, None),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 32, 32),
    "longrope": (LONGROPE, 128, 32),
}



@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    rope, max_pos, switch = CASES[request.param]
    directory = write_tiny_llama(tmp_path_factory.mktemp(request.param), "llama", seed=len(request.param),
                                 with_tokenizer=False, rope_scaling=dict(rope), max_position_embeddings=max_pos)
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    return request.param, directory, hf, switch


def _hf_generate(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and the logits of each of its steps (n, vocab)."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def test_rope_type_is_read(case) -> None:
    name, directory, _, _ = case
    cfg, _ = load_model(directory)
    assert cfg.rope_scaling.kind == name.split("-")[0]


def test_logits_match_hf_within_the_frequency_switch(case) -> None:
    """A single forward: YaRN over 100 positions (3x its original context); dynamic and
    LongRoPE over their original context, where HF and we use the same frequencies."""
    _, directory, hf, switch = case
    _, model = load_model(directory)
    tokens = torch.randint(0, 301, (switch or 100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(full_logits(model, tokens, block_size=8), expected, atol=LOGITS_ATOL, rtol=0)


def test_continuation_past_the_original_context_matches_hf_generate(case) -> None:
    """A 20-token prompt and 32 greedy tokens: positions 20..51, past the original context of
    every case. Our logits at each step's position equal HF generate's; the tokens are HF's."""
    _, directory, hf, _ = case
    _, model = load_model(directory)
    prompt = torch.randint(0, 301, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    tokens, logits = _hf_generate(hf, prompt, GREEDY)
    ours = full_logits(model, prompt + tokens[:-1], block_size=8)[len(prompt) - 1:]
    torch.testing.assert_close(ours, logits, atol=LOGITS_ATOL, rtol=0)
    runs = engine_greedy_runs(directory, prompt, GREEDY, vocab=301)
    assert runs == dict.fromkeys(runs, tokens)


@pytest.mark.parametrize("case", ["longrope", "dynamic"], indirect=True)
def test_prompt_past_the_original_context_is_rotated_as_hf_prefills_it(case) -> None:
    """A 40-token prompt (original context 32): HF's prefill rotates all of it as a sequence of
    40 (LongRoPE: the long factors; dynamic NTK: the base of length 40), then each generated
    token as a sequence ending there, keeping the cache (no Phi-3 recompute for a Llama); so do
    we, also from the prefix cache, batched and preempted. Per position alone is far off."""
    name, directory, _, _ = case
    # A fresh HF model: HF's dynamic NTK keeps the frequencies of the longest sequence it has seen
    # (above the original context), so the fixture's, after the tests before, would rotate as 52.
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    _, model = load_model(directory)
    prompt = torch.randint(0, 301, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(full_logits(model, prompt, block_size=8, rope_len=len(prompt)), expected,
                               atol=LOGITS_ATOL, rtol=0)
    assert (full_logits(model, prompt, block_size=8) - expected).abs().max() > 1e-2
    n = GREEDY if name == "longrope" else 24  # dynamic serves 2 x 32 positions
    tokens, _ = _hf_generate(hf, prompt, n)  # after a forward over 40: HF's state is that of its prefill
    runs = engine_greedy_runs(directory, prompt, n, vocab=301)
    assert runs == dict.fromkeys(runs, tokens)


def test_dynamic_ntk_extends_the_context_by_its_factor(tmp_path) -> None:
    directory = write_tiny_llama(tmp_path, "llama", with_tokenizer=False, max_position_embeddings=32,
                                 rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    cfg, _ = load_model(directory)
    assert (cfg.max_position, cfg.rope_scaling.original_max_position) == (64, 32)


def test_longrope_without_its_factors_is_named(tmp_path) -> None:
    directory = write_tiny_llama(tmp_path, "llama", with_tokenizer=False, rope_scaling=dict(LONGROPE))
    import json

    raw = json.loads((directory / "config.json").read_text())
    del raw["rope_parameters"]["long_factor"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="longrope scaling needs short_factor and long_factor"):
        load_model(directory)
