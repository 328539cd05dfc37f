"""Prefix caching in the engine never changes outputs: requests sharing prefixes give the same
tokens (greedy and seeded sampling) and logprobs with caching on as off, for both attention
kinds, under forced preemption and with aborts in the middle."""

from __future__ import annotations

import random

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.builder import build_engine

KV_BYTES = 32 << 20
SYSTEM = list(b"You are a careful assistant. Answer briefly and never make things up. ")  # 70 tokens


def workload(n: int = 6) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts, params = [], []
    for i in range(n):
        user = [rng.randrange(256) for _ in range(rng.randint(3, 30))]
        prompts.append(SYSTEM + user if i % 4 else SYSTEM[:40] + user)  # full and partial shared prefixes
        params.append(SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2,
                                     temperature=0.0 if i % 2 else 0.9, seed=100 + i))
    prompts.append(list(SYSTEM))  # a prompt that is exactly the shared prefix
    params.append(SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, temperature=0.0))
    return prompts, params


def assert_same(got, ref) -> None:
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.fixture(scope="module", params=["transformer-base", "transformer-base-additive"])
def reference(request):
    prompts, params = workload()
    llm = LLM(request.param, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False))
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().prefix_cache_queries == 0
    return request.param, outs


def test_caching_on_gives_the_same_outputs_and_hits(reference) -> None:
    model, ref = reference
    prompts, params = workload()
    llm = LLM(model, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES))
    assert_same(llm.generate(prompts, params), ref)
    # The second round finds every full prompt block cached (the last token is always computed).
    assert_same(llm.generate(prompts, params), ref)
    stats = llm.engine.stats()
    total = 2 * sum(len(p) for p in prompts)
    assert stats.prefix_cache_queries == total
    assert stats.prefix_cache_hits > sum(((len(p) - 1) // 16) * 16 for p in prompts)


def test_forced_preemption_with_caching_gives_the_same_outputs(reference) -> None:
    model, ref = reference
    prompts, params = workload()
    # 8 blocks of 16 tokens cannot hold 7 sequences of ~80 tokens: preemption is forced.
    llm = LLM(model, engine_config=EngineConfig(num_kv_blocks=8, block_size=16))
    assert_same(llm.generate(prompts, params), ref)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == 8


def test_aborts_in_the_middle_leave_the_others_unchanged_and_the_pool_full(reference) -> None:
    model, ref = reference
    prompts, params = workload()
    engine = build_engine(model, EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=48))
    tokens: dict[str, list[int]] = {}
    for i in range(4):
        engine.add_request(str(i), prompts[i], params[i])
    for _ in range(3):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.abort_request("1")  # mid-prefill or decoding, holding blocks shared with the others
    engine.abort_request("2")
    for i in range(4, len(prompts)):
        engine.add_request(str(i), prompts[i], params[i])
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i in (0, 3, *range(4, len(prompts))):
        assert tokens[str(i)] == ref[i].token_ids, i
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert (stats.num_free_blocks, stats.kv_cache_usage) == (stats.num_total_blocks, 0.0)
