"""An engine replica's KV events reaching the cluster's KV index (`EngineHost.publish_kv_events`,
service/host/engine_host.py): a real engine with events on, on its step thread, publishing to a
`KVIndex` in this process as the `KVIndex` deployment would receive them; the index then finds
the prompt the engine computed, hashed as the engine hashes it."""

from __future__ import annotations

import asyncio
from typing import Any

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.sampling.params import SamplingParams
from service.engine.engine_loop import SubRequest
from service.host.engine_host import EngineHost
from service.routing.kv_index import KVIndex
from tests.support.in_process import NullMetrics
from tests.support.local_serve import write_tiny_checkpoint
from tests.support.polling import wait_until_async

BLOCK = 16


def test_the_engines_events_reach_the_index_and_it_finds_the_prompt(tmp_path) -> None:
    model = write_tiny_checkpoint(tmp_path / "tiny")
    engine = build_engine(str(model), EngineConfig(block_size=BLOCK, num_kv_blocks=64, enable_kv_cache_events=True),
                          device="cpu")
    index = KVIndex()
    layout = (BLOCK, engine.prefix_salt.hex())
    sent: list[list[Any]] = []

    async def publish(batches: list[Any]) -> None:
        sent.append(batches)
        index.publish("replica-1", batches, layout)

    prompt = list(range(3, 3 + 3 * BLOCK + 5))  # three full blocks and a partial one

    async def run() -> None:
        host = EngineHost(engine, "tiny", metrics=NullMetrics())
        try:
            publisher = host.publish_kv_events(publish, interval_s=0.01)
            await wait_until_async(lambda: len(sent) >= 2, 30, "heartbeats before any request")
            assert index.lookup(prompt) == {}
            stream = host.generate([SubRequest("r1", prompt, SamplingParams(max_tokens=2, temperature=0))])
            async for outputs in stream:
                if any(o.finished for o in outputs):
                    break
            await wait_until_async(lambda: index.lookup(prompt).get("replica-1") == 3, 30,
                                   "the index to hold the prompt's three full blocks")
            assert index.lookup(prompt[:BLOCK] + [1] * 40) == {"replica-1": 1}  # only the first block shared
        finally:
            host.stop()
        # No heartbeat for a stopped engine (the index forgets it): the publisher ends by itself
        # (a cycle in flight when the engine stopped may still send), without an error.
        await wait_until_async(publisher.done, 30, "the publisher to end after the engine stopped")
        assert publisher.exception() is None

    asyncio.run(run())
    assert any(not batches for batches in sent)  # heartbeats: empty lists
    assert sum(len(b.events) for batches in sent for b in batches) >= 1


def _engine(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "tiny")
    return build_engine(str(model), EngineConfig(block_size=BLOCK, num_kv_blocks=64, enable_kv_cache_events=True),
                        device="cpu")


async def _generate(host: EngineHost, rid: str, prompt: list[int]) -> None:
    async for outputs in host.generate([SubRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0))]):
        if any(o.finished for o in outputs):
            return


def test_events_a_failed_send_did_not_deliver_go_with_the_next(tmp_path, monkeypatch) -> None:
    """The index is down for a while: the batches go again, in order, once it answers; past the
    cap they give way to one AllBlocksCleared, so the index forgets rather than keeps a stale view."""
    import service.host.engine_host as engine_host

    engine = _engine(tmp_path)
    index = KVIndex()
    layout = (BLOCK, engine.prefix_salt.hex())
    down = {"on": True}
    tries: list[int] = []

    async def publish(batches: list[Any]) -> None:
        tries.append(len(batches))
        if down["on"]:
            raise ConnectionError("the index is restarting")
        index.publish("replica-1", batches, layout)

    first, second, third, fourth = (list(range(start, start + 2 * BLOCK + 1)) for start in (3, 90, 150, 200))

    async def run() -> None:
        host = EngineHost(engine, "tiny", metrics=NullMetrics())
        try:
            host.publish_kv_events(publish, interval_s=0.01)
            await _generate(host, "r1", first)
            await wait_until_async(lambda: tries and tries[-1] >= 1, 30, "a send carrying the events, failing")
            down["on"] = False  # the index answers again: the undelivered batches arrive
            await wait_until_async(lambda: index.lookup(first).get("replica-1") == 2, 30, "the resent blocks")
            # Down again for longer than the cap allows: the index is told to forget, not left stale.
            monkeypatch.setattr(engine_host, "KV_UNSENT_MAX", 1)
            down["on"] = True
            for rid, prompt in (("r2", second), ("r3", third)):  # two undelivered batches: past the cap of one
                await _generate(host, rid, prompt)
                before = len(tries)  # the prompt's events drained (a publish cycle after it) before the next
                await wait_until_async(lambda: len(tries) >= before + 2, 30, "sends while the index is down")
            down["on"] = False
            await wait_until_async(lambda: all(index.lookup(p) == {} for p in (first, second, third)), 30,
                                   "the index to forget the replica's blocks")
            await _generate(host, "r4", fourth)  # what the replica computes from now on is known again
            await wait_until_async(lambda: index.lookup(fourth).get("replica-1") == 2, 30, "the new blocks")
        finally:
            host.stop()

    asyncio.run(run())
