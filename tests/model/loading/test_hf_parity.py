"""GPT-2 checkpoints saved by HF transformers give HF's logits and greedy continuations.

Tiny random GPT-2s of several shapes (odd vocabulary sizes, one sharded) are built with
`transformers`, saved with `save_pretrained`, and loaded with `model.loading.checkpoint.load_model`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import LLM, SamplingParams
from model.loading.checkpoint import load_model
from tests.support.tiny_models import full_logits, hf_greedy, save_tiny_gpt2
from tests.support.requirements import need_module

transformers = need_module("transformers")

# (n_layer, n_head, n_embd, vocab_size, sharded)
SHAPES = [(1, 1, 32, 263, False), (2, 4, 64, 301, True), (3, 2, 96, 517, False)]
LOGITS_ATOL = 1e-4  # fp32; the observed difference is ~1e-6
GREEDY_TOKENS = 32


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"L{s[0]}-H{s[1]}-D{s[2]}-V{s[3]}{'-sharded' if s[4] else ''}")
def checkpoint(request, tmp_path_factory) -> tuple[Path, "transformers.GPT2LMHeadModel"]:
    """A saved tiny GPT-2 directory and HF's own model loaded back from it."""
    n_layer, n_head, n_embd, vocab, sharded = request.param
    directory = save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer, n_head, n_embd, vocab_size=vocab,
                               seed=n_layer, sharded=sharded)
    if sharded:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    return directory, hf


def _random_tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_logits_match_hf(checkpoint) -> None:
    directory, hf = checkpoint
    cfg, model = load_model(directory)
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.vocab_size) == (
        "gpt2", hf.config.n_layer, hf.config.n_embd, hf.config.vocab_size)
    tokens = _random_tokens(50, cfg.vocab_size, seed=1)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]  # (T, vocab)
    got = full_logits(model, tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


def test_greedy_continuation_matches_hf(checkpoint) -> None:
    directory, hf = checkpoint
    prompt = _random_tokens(8, hf.config.vocab_size, seed=2).tolist()
    expected = hf_greedy(hf, prompt, GREEDY_TOKENS)
    assert len(expected) == GREEDY_TOKENS
    llm = LLM(str(directory), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].token_ids
    assert got == expected
