"""The continuous-batching engine: a request's output does not depend on what else runs with it,
on preemption, or on how its prompt was chunked; aborts return every KV block."""

from __future__ import annotations

import random

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine

MODEL = "transformer-base"
KV_BYTES = 64 << 20


@pytest.fixture(scope="module")
def needle() -> list[int]:
    return list(b"The needle in the haystack is a request whose output must not change.")


def others(n: int, seed: int = 1) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 120))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8]),
                             seed=rng.randrange(1000), ignore_eos=True) for _ in range(n)]
    return prompts, params


def needle_params() -> list[SamplingParams]:
    # Greedy and seeded sampling: a seeded sample is as sensitive to the logits as greedy is.
    return [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=3),
            SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True, logprobs=3)]


def assert_same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


@pytest.fixture(scope="module", params=["transformer-base", "transformer-base-additive"])
def alone(request, needle):
    llm = LLM(request.param, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES))
    return request.param, llm.generate([needle, needle], needle_params())


def test_needle_alone_equals_needle_in_a_batch_of_32(alone, needle) -> None:
    model, ref = alone
    llm = LLM(model, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES))
    prompts, params = others(32)
    outs = llm.generate(prompts[:16] + [needle] + prompts[16:] + [needle], params[:16] + needle_params()[:1]
                        + params[16:] + needle_params()[1:])
    assert_same(outs[16], ref[0])
    assert_same(outs[-1], ref[1])


def test_preemption_never_changes_outputs(alone, needle) -> None:
    model, ref = alone
    # 24 blocks of 16 tokens cannot hold 33 sequences of up to 160 tokens: preemption is forced.
    llm = LLM(model, engine_config=EngineConfig(num_kv_blocks=24, block_size=16))
    prompts, params = others(32, seed=2)
    outs = llm.generate([needle] + prompts + [needle], needle_params()[:1] + params + needle_params()[1:])
    assert llm.engine.stats().num_preemptions_total > 0
    assert_same(outs[0], ref[0])
    assert_same(outs[-1], ref[1])
    solo = LLM(model, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES)).generate(prompts[:4], params[:4])
    for a, b in zip(outs[1:5], solo):
        assert a.token_ids == b.token_ids


def test_small_prefill_chunks_never_change_outputs(alone, needle) -> None:
    model, ref = alone
    llm = LLM(model, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=7))
    outs = llm.generate([needle, needle], needle_params())
    assert_same(outs[0], ref[0])
    assert_same(outs[1], ref[1])


def test_disabled_kv_cache_gives_the_same_tokens(alone, needle) -> None:
    model, ref = alone
    cfg = EngineConfig(kv_cache_memory_bytes=KV_BYTES, enable_kv_cache=False, max_num_batched_tokens=4096)
    outs = LLM(model, engine_config=cfg).generate([needle], needle_params()[:1])
    assert_same(outs[0], ref[0])


def drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_abort_running_and_waiting_returns_the_pool_to_full() -> None:
    engine = build_engine(MODEL, EngineConfig(num_kv_blocks=16, block_size=16, max_num_seqs=2))
    for i in range(4):
        engine.add_request(f"r{i}", list(range(1, 60)), SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.num_waiting == 2 and stats.num_free_blocks < 16
    for i in range(4):
        engine.abort_request(f"r{i}")
    outs = drain(engine)
    assert sorted(o.request_id for o in outs if o.finish_reason == "abort") == ["r0", "r1", "r2", "r3"]
    stats = engine.stats()
    assert (stats.num_free_blocks, stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (16, 0, 0, 0.0)
    engine.abort_request("never-existed")  # ignored


def test_finished_requests_free_their_blocks_and_report_times() -> None:
    engine = build_engine(MODEL, EngineConfig(num_kv_blocks=16, block_size=16))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    outs = drain(engine)
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    last = outs[-1]
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 5
    t = last.times
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.last_token <= t.finished
    assert engine.stats().num_free_blocks == 16


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "at least one token"),
    ([300], SamplingParams(), "outside the vocabulary"),
    ([1] * 1000, SamplingParams(max_tokens=100), "maximum context length is 1024 tokens. However, you requested 1100"),
    # Suppressed while below min_tokens: an id past the logits would fail the whole batch's step.
    ([1], SamplingParams(stop_token_ids=[258], min_tokens=1),
     "token id 258 in stop_token_ids is outside the vocabulary"),
    ([1], SamplingParams(logit_bias={258: 1.0}), "token id 258 in logit_bias is outside the vocabulary"),
])
def test_add_request_rejects_bad_input(prompt, params, message) -> None:
    engine = build_engine(MODEL, EngineConfig(num_kv_blocks=128))
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished()


def test_duplicate_request_id_and_oversized_request_are_rejected() -> None:
    engine = build_engine(MODEL, EngineConfig(num_kv_blocks=4, block_size=16))
    engine.add_request("x", [1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="needs 7 KV blocks but the pool has 4"):
        engine.add_request("y", [1] * 50, SamplingParams(max_tokens=50))


def test_the_engine_measures_what_a_prompt_token_costs() -> None:
    """What a cross-node prefix fetch is weighed against (service/replica/peer_fetch.py)."""
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=64))
    one = SamplingParams(max_tokens=1)
    assert llm.engine.prefill_seconds_per_token is None
    llm.generate([[7] * 40], [one])  # a step of 40 tokens is too small to measure by
    assert llm.engine.prefill_seconds_per_token is None
    llm.generate([[7] * 300], [one])
    assert llm.engine.prefill_seconds_per_token is not None and llm.engine.prefill_seconds_per_token > 0
