"""Cross-node prefix fetch, the replica's client (service/replica/peer_fetch.py), in one process:
two engines stand for two replicas, the KV index and the peer's handle are stand-ins, and the
blocks travel as they are. A fetched prefix gives the tokens of a recompute; a peer that fails,
times out, sends damaged bytes or no longer holds the blocks leaves the prompt to be computed
here, counted by reason; the cost model skips a fetch slower than the prefill it would save."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from service.engine.engine_loop import SubRequest
from service.replica.kv_connector import checksummed
from service.replica.peer_fetch import PEER_BACKOFF_S, PeerFetch
from tests.model.engine.test_kv_offload import MODEL, workload
from tests.service.replica.test_pd_disaggregation import POOL, Recorder

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)


class Index:
    """The KV index's handle: `lookup` answers `runs` (replica -> leading pool blocks held)."""

    def __init__(self, runs: dict[str, int]) -> None:
        self.runs = runs
        self.asked: list[list[str] | None] = []

        class lookup:  # noqa: N801 (a handle's method, as Serve spells it)
            @staticmethod
            def remote(prompt, lora, tiers=None):
                async def call():
                    self.asked.append(tiers)
                    return dict(self.runs)
                return call()

        self.lookup = lookup


class Peer:
    """The engine deployment's handle, each call reaching `holder` (the replica `ToReplica` names)."""

    def __init__(self, holder: LLM, fault: str | None = None) -> None:
        self.holder, self.fault, self.targets = holder, fault, []
        peer = self

        class export_cached:  # noqa: N801
            @staticmethod
            def remote(route, prompt, lora):
                async def call():
                    peer.targets.append(route.replica_unique_id)
                    if peer.fault == "dead":
                        raise RuntimeError("the peer's actor died")
                    if peer.fault == "slow":
                        await asyncio.sleep(10)
                    blocks = await checksummed(peer.holder.engine.export_prefix(prompt, lora))
                    if peer.fault == "corrupt":  # one byte of the third block flipped on the way
                        data = blocks.data.clone()
                        data[2 * blocks.block_nbytes + 7] ^= 0xFF
                        blocks = dataclasses.replace(blocks, data=data)
                    return blocks
                return call()

        self.export_cached = export_cached


class Connector:  # in-process: the blocks themselves travel
    async def receive(self, transfer):
        return transfer


def client(here: LLM, holder: LLM, runs: dict[str, int], fault: str | None = None,
           min_tokens: int = 32) -> tuple[PeerFetch, SimpleNamespace, Peer, Index]:
    metrics = SimpleNamespace(remote_fetch_blocks=Recorder(), remote_fetch_bytes=Recorder(),
                              remote_fetch_time=Recorder(), remote_fetch_fallbacks=Recorder(),
                              remote_fetch_skipped=Recorder())

    async def between_steps(fn):
        return fn()

    host = SimpleNamespace(metrics=metrics, engine=here.engine, loop=SimpleNamespace(run_between_steps=between_steps))
    peer, index = Peer(holder, fault), Index(runs)
    fetch = PeerFetch(host, index, lambda: peer, "here", min_tokens, timeout_s=0.5, connector=Connector())
    return fetch, metrics, peer, index


def engines() -> tuple[LLM, LLM]:
    return tuple(LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL)) for _ in range(2))


def fallbacks(metrics: SimpleNamespace) -> list[str]:
    return [tags["reason"] for _, tags in metrics.remote_fetch_fallbacks.calls]


def skips(metrics: SimpleNamespace) -> list[str]:
    return [tags["reason"] for _, tags in metrics.remote_fetch_skipped.calls]


@pytest.fixture(scope="module")
def recomputed() -> list[int]:
    """The greedy tokens of the first workload prompt, computed from scratch."""
    prompt = workload()[0][0]
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, enable_prefix_caching=False))
    return llm.generate([prompt], [GREEDY])[0].token_ids


def test_a_prefix_fetched_from_the_peer_that_holds_it_gives_the_tokens_of_a_recompute(recomputed) -> None:
    here, holder = engines()
    prompt = workload()[0][0]  # 85 tokens: 5 full blocks
    holder.generate([prompt], [GREEDY])
    fetch, metrics, peer, index = client(here, holder, {"holder": 5, "here": 0})
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY), SubRequest("b", prompt, GREEDY)]))  # n=2: one fetch
    assert peer.targets == ["holder"] and index.asked == [None]  # held in any tier the index knows
    assert metrics.remote_fetch_blocks.calls == [(5, None)]
    assert metrics.remote_fetch_bytes.calls == [(5 * here.engine.incoming.pool.block_nbytes, None)]
    assert len(metrics.remote_fetch_time.calls) == 1 and fallbacks(metrics) == []
    assert fetch.cost.bytes_per_s is not None  # the link is measured from here on
    assert here.generate([prompt], [GREEDY])[0].token_ids == recomputed
    assert here.engine.incoming.loaded_blocks == 5 and here.engine.stats().prefix_cache_hits == 80
    # Its pool now holds the prefix: no second lookup, no second fetch.
    asyncio.run(fetch.fetch([SubRequest("c", prompt, GREEDY)]))
    assert peer.targets == ["holder"] and len(index.asked) == 1


def test_a_prefix_a_peer_holds_only_in_its_offload_tier_is_fetched_with_the_tokens_of_a_recompute(recomputed) -> None:
    here = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL))
    holder = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, kv_offload_bytes=64 << 20))
    prompts = workload()[0]
    holder.generate(prompts[:4], [GREEDY] * 4)  # the first prompt's blocks leave the pool for the tier
    assert holder.engine.scheduler.blocks.cached_prefix(prompts[0])[1] == []
    fetch, metrics, peer, _ = client(here, holder, {"holder": 5, "here": 0})
    asyncio.run(fetch.fetch([SubRequest("a", prompts[0], GREEDY)]))
    assert peer.targets == ["holder"] and metrics.remote_fetch_blocks.calls == [(5, None)]
    assert fallbacks(metrics) == []
    assert here.generate([prompts[0]], [GREEDY])[0].token_ids == recomputed
    assert here.engine.incoming.loaded_blocks == 5


def test_a_prefix_held_in_this_replicas_own_tier_is_not_fetched() -> None:
    _, holder = engines()
    here = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=POOL, kv_offload_bytes=64 << 20))
    prompts = workload()[0]
    holder.generate([prompts[0]], [GREEDY])
    here.generate(prompts[:4], [GREEDY] * 4)  # here's tier now holds the first prompt's blocks
    fetch, metrics, peer, index = client(here, holder, {"holder": 5, "here": 5})
    asyncio.run(fetch.fetch([SubRequest("a", prompts[0], GREEDY)]))
    assert peer.targets == [] and index.asked == [] and metrics.remote_fetch_blocks.calls == []


def test_damaged_blocks_and_the_ones_after_them_are_computed_and_counted(recomputed) -> None:
    here, holder = engines()
    prompt = workload()[0][0]
    holder.generate([prompt], [GREEDY])
    fetch, metrics, _, _ = client(here, holder, {"holder": 5}, fault="corrupt")
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    assert fallbacks(metrics) == ["corrupt"]
    assert metrics.remote_fetch_blocks.calls == [(2, None)]  # the two blocks before the damaged one
    assert here.generate([prompt], [GREEDY])[0].token_ids == recomputed
    assert here.engine.incoming.loaded_blocks == 2 and here.engine.stats().prefix_cache_hits == 32


@pytest.mark.parametrize("fault,reason", [("dead", "unavailable"), ("slow", "timeout")])
def test_a_peer_that_fails_is_counted_and_not_asked_again_for_a_while(recomputed, fault, reason) -> None:
    here, holder = engines()
    prompt = workload()[0][0]
    holder.generate([prompt], [GREEDY])
    fetch, metrics, peer, _ = client(here, holder, {"holder": 5}, fault=fault)
    now = [100.0]
    fetch._clock = lambda: now[0]
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    asyncio.run(fetch.fetch([SubRequest("b", prompt, GREEDY)]))
    assert peer.targets == ["holder"] and fallbacks(metrics) == [reason]
    assert metrics.remote_fetch_blocks.calls == []
    now[0] += PEER_BACKOFF_S + 1  # once its backoff is over, it is asked again
    asyncio.run(fetch.fetch([SubRequest("c", prompt, GREEDY)]))
    assert peer.targets == ["holder", "holder"] and fallbacks(metrics) == [reason, reason]
    assert here.generate([prompt], [GREEDY])[0].token_ids == recomputed
    assert here.engine.incoming.loaded_blocks == 0


def test_a_peer_that_no_longer_holds_the_blocks_is_counted_empty() -> None:
    here, holder = engines()
    prompt = workload()[0][0]  # the holder never computed it: the index's view is stale
    fetch, metrics, peer, _ = client(here, holder, {"holder": 5})
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    assert peer.targets == ["holder"] and fallbacks(metrics) == ["empty"]


def test_nothing_is_asked_for_short_prompts_prompts_held_here_or_held_by_no_peer() -> None:
    here, holder = engines()
    prompt = workload()[0][0]
    holder.generate([prompt], [GREEDY])
    fetch, metrics, peer, index = client(here, holder, {"holder": 5}, min_tokens=100)
    asyncio.run(fetch.fetch([SubRequest("short", prompt, GREEDY)]))  # 85 < 100 tokens
    assert index.asked == [] and peer.targets == [] and skips(metrics) == []
    fetch, metrics, peer, index = client(here, holder, {"here": 5})  # only this replica holds it
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    assert len(index.asked) == 1 and peer.targets == [] and skips(metrics) == ["none"]
    here.generate([prompt], [GREEDY])
    fetch, metrics, peer, index = client(here, holder, {"holder": 5})  # this pool holds it now
    asyncio.run(fetch.fetch([SubRequest("b", prompt, GREEDY)]))
    assert index.asked == [] and peer.targets == [] and metrics.remote_fetch_fallbacks.calls == []
    assert skips(metrics) == []  # not a prompt this replica lacks


def test_an_index_that_does_not_answer_in_time_is_counted_and_the_prompt_computed_here() -> None:
    here, holder = engines()
    prompt = workload()[0][0]
    fetch, metrics, peer, index = client(here, holder, {"holder": 5})

    class slow_lookup:  # noqa: N801
        @staticmethod
        def remote(prompt, lora, tiers=None):
            return asyncio.sleep(10, result={"holder": 5})

    index.lookup = slow_lookup
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    assert peer.targets == [] and skips(metrics) == ["index"] and fallbacks(metrics) == []


def test_a_fetch_measured_slower_than_the_prefill_it_saves_is_skipped() -> None:
    here, holder = engines()
    prompt = workload()[0][0]
    holder.generate([prompt], [GREEDY])
    fetch, metrics, peer, _ = client(here, holder, {"holder": 5})
    here.engine.prefill_seconds_per_token = 1e-4  # 80 tokens: 8 ms to compute
    fetch.cost.observe(1000, 1.0)  # a link of 1 kB/s: minutes for 5 blocks
    asyncio.run(fetch.fetch([SubRequest("a", prompt, GREEDY)]))
    assert peer.targets == [] and fetch.skipped == 1 and metrics.remote_fetch_blocks.calls == []
    assert skips(metrics) == ["cost"]
    fetch.cost.bytes_per_s = 1e12  # a link that moves them in no time
    asyncio.run(fetch.fetch([SubRequest("b", prompt, GREEDY)]))
    assert peer.targets == ["holder"] and metrics.remote_fetch_blocks.calls == [(5, None)]

