"""Prompt logprobs (vLLM's `prompt_logprobs`, behind the API's `echo` + `logprobs`): each prompt
token's log-probability given the tokens before it, equal to HF transformers' full forward pass,
whatever the chunking of the prefill, the batch around it, or the prefix cache."""

from __future__ import annotations

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from tests.support.tiny_models import save_tiny_gpt2
from tests.support.requirements import need_module

transformers = need_module("transformers")

VOCAB = 301
TOP = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, "transformers.GPT2LMHeadModel"]:
    directory = save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), vocab_size=VOCAB, seed=4)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    # Chunks of at most 8 tokens: a 30-token prompt is prefilled over several steps.
    llm = LLM(str(directory), engine_config=EngineConfig(max_num_batched_tokens=8, kv_cache_memory_bytes=8 << 20))
    return llm, hf


def _reference(hf: "transformers.GPT2LMHeadModel", ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # (P, V)
    picked = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).view(-1)  # token i+1 given tokens <= i
    return picked, torch.topk(logp[:-1], TOP).indices


def _check(out, hf, ids: list[int]) -> None:
    want, top = _reference(hf, ids)
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) - 1
    assert [lp.token_id for lp in got] == ids[1:]
    assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=1e-4)
    assert [[t for t, _ in lp.top] for lp in got] == top.tolist()


def test_prompt_logprobs_equal_hf_over_chunked_prefill_beside_a_decoding_request(models) -> None:
    llm, hf = models
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    wanted = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    # The short prompt is decoding while the long one prefills chunk by chunk in the same steps.
    other, out = llm.generate([[5, 6], ids], [plain, wanted])
    assert other.prompt_logprobs is None
    _check(out, hf, ids)
    # The generation itself is the same as without prompt logprobs.
    (again,) = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert again.token_ids == out.token_ids


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(models) -> None:
    llm, hf = models
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=2, temperature=0))  # its full blocks are now cached
    (out,) = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    want, _ = _reference(hf, ids)
    assert torch.allclose(torch.tensor([lp.logprob for lp in out.prompt_logprobs]), want, atol=1e-4)
    assert all(lp.top == [] for lp in out.prompt_logprobs)


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in \\[0, 20\\]"):
        SamplingParams(prompt_logprobs=21)
