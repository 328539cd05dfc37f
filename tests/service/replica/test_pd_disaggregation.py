"""Prefill/decode disaggregation, the engine's side (model/engine/kv/transfer.py): a prefill
engine computes a prompt and exports its blocks, a decode engine receives them and decodes; the
tokens are those of colocated serving (greedy and seeded, one by one and batched under
preemption), blocks of another model or layout are refused, and nothing is left held."""

from __future__ import annotations

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.kv.transfer import IncomingBlocks
from tests.model.engine.test_kv_offload import MODEL, workload

POOL = 12
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def reference() -> list:
    prompts, params = workload()
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, enable_prefix_caching=False))
    return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]


def transfer(prefill: LLM, decode: LLM, prompt: list[int]) -> bool:
    prefill.generate([prompt], [ONE])
    blocks = prefill.engine.export_prefix(prompt)
    assert len(blocks.keys) == len(prompt) // 16 and blocks.data.numel() == blocks.nbytes
    return decode.engine.receive_prefix(blocks)


def test_decoding_from_transferred_blocks_gives_the_colocated_tokens(reference) -> None:
    prefill, decode = (LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL)) for _ in range(2))
    prompts, params = workload()
    got = []
    for p, sp in zip(prompts, params):
        assert transfer(prefill, decode, p)
        got.append(decode.generate([p], [sp])[0].token_ids)
    assert got == reference
    stats = decode.engine.stats()
    # each prompt's 5 full blocks: from the transfer (or, the second ask, still in the pool)
    assert decode.engine.incoming.loaded_blocks >= 4 * 5 and stats.prefix_cache_hits >= 8 * 80
    assert stats.num_free_blocks == POOL


def test_many_transfers_then_a_preempting_batch_gives_the_colocated_tokens(reference) -> None:
    prefill, decode = (LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL)) for _ in range(2))
    prompts, params = workload()
    for p in prompts:
        assert transfer(prefill, decode, p)
    assert [o.token_ids for o in decode.generate(prompts, params)] == reference
    stats = decode.engine.stats()
    assert stats.num_preemptions_total > 0 and decode.engine.incoming.loaded_blocks > 0
    assert stats.num_free_blocks == POOL


def test_blocks_of_another_layout_are_refused() -> None:
    prefill = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL))
    other = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, kv_cache_dtype="bfloat16"))
    prompts, _ = workload()
    assert not transfer(prefill, other, prompts[0])
    assert other.engine.incoming.num_blocks == 0


def test_only_the_last_transfers_are_kept_and_an_unused_one_costs_nothing(reference) -> None:
    prefill, decode = (LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL)) for _ in range(2))
    decode.engine.incoming.max_transfers = 2
    prompts, params = workload()
    for p in prompts[:4]:  # four transfers, room for two: the first two are dropped
        transfer(prefill, decode, p)
    assert decode.engine.incoming.num_blocks == 2 * 5
    got = [decode.generate([p], [sp])[0].token_ids for p, sp in zip(prompts[:4], params[:4])]
    assert got == reference[:4]
    assert decode.engine.incoming.loaded_blocks == 2 * 5 and decode.engine.incoming.num_blocks == 0


def test_an_engine_without_a_prefix_cache_takes_no_blocks_and_exports_none() -> None:
    prefill = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL))
    plain = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, enable_prefix_caching=False))
    prompts, _ = workload()
    assert not transfer(prefill, plain, prompts[0])
    with pytest.raises(ValueError, match="needs prefix caching"):
        plain.engine.export_prefix(prompts[0])
    assert isinstance(prefill.engine.incoming, IncomingBlocks) and plain.engine.incoming is None


# ---- the decode replica's client: outcomes and metrics ---------------------------------------------

class Recorder:
    """A Ray metric's stand-in that keeps what was recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, dict | None]] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.calls.append((value, tags))

    observe = inc


def test_the_decode_replicas_client_counts_each_outcome_and_prefills_itself_on_failure() -> None:
    import asyncio
    from types import SimpleNamespace

    from service.engine.engine_loop import SubRequest
    from service.replica.kv_connector import RemotePrefill

    prefill, decode = (LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL)) for _ in range(2))
    prompts, _ = workload()

    class Connector:  # in-process: the blocks themselves travel
        def send(self, blocks):
            return blocks

        async def receive(self, transfer):
            return transfer

    async def scenario(fail: BaseException | None, mm: object = None) -> SimpleNamespace:
        metrics = SimpleNamespace(transfers=Recorder(), transfer_bytes=Recorder(), transfer_fetch_time=Recorder(),
                                  transfer_time=Recorder())

        async def between_steps(fn):
            return fn()

        host = SimpleNamespace(metrics=metrics, engine=decode.engine, loop=SimpleNamespace(run_between_steps=between_steps))

        class Handle:
            class prefill:  # noqa: N801 (a handle's method, as Serve spells it)
                @staticmethod
                def remote(prompt, lora):
                    async def call():
                        if fail is not None:
                            raise fail
                        prefill.generate([prompt], [ONE])
                        return Connector().send(prefill.engine.export_prefix(prompt, lora))
                    return call()

        client = RemotePrefill(Handle(), host, min_tokens=32, timeout_s=60, connector=Connector())
        requests = [SubRequest(f"r{i}", prompts[0], SamplingParams(), mm=mm) for i in range(2)]  # n=2: one prompt
        await client.fetch(requests + [SubRequest("short", [1, 2, 3], SamplingParams())])
        return metrics

    ok = asyncio.run(scenario(None))
    assert ok.transfers.calls == [(1.0, {"outcome": "received"})]
    assert ok.transfer_bytes.calls == [(5 * decode.engine.incoming.pool.block_nbytes, None)]
    assert len(ok.transfer_time.calls) == 1 and len(ok.transfer_fetch_time.calls) == 1
    assert decode.engine.incoming.num_blocks == 5
    # A prompt with images is prefilled where it decodes (the prefill deployment takes ids only).
    with_images = asyncio.run(scenario(RuntimeError("must not be called"), mm=object()))
    assert with_images.transfers.calls == []
    failed = asyncio.run(scenario(RuntimeError("the prefill replica died")))
    assert failed.transfers.calls == [(1.0, {"outcome": "failed"})] and failed.transfer_bytes.calls == []
    # Once the decode engine has computed the prompt, its pool holds every full block: no call at all.
    decode.generate([prompts[0]], [ONE])
    assert decode.engine.cached_prefix_blocks(prompts[0]) == (5, 5)
    held = asyncio.run(scenario(RuntimeError("must not be called")))
    assert held.transfers.calls == [(1.0, {"outcome": "cached"})]
