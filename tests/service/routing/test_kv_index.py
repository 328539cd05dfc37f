"""The cluster's KV index (service/routing/kv_index.py) built from the events real block managers
publish: what it says each replica holds is what each replica's pool holds, through stores,
evictions and clears; a replica that stops publishing is forgotten after its ttl. No torch."""

from __future__ import annotations

import random

import pytest

from model.engine.kv.block_manager import BlockManager
from model.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventLog
from model.engine.scheduler import Scheduler
from model.engine.sequence import Sequence
from model.sampling.params import SamplingParams
from service.routing.kv_index import KVIndex

BS = 4


class Replica:
    """A block manager and scheduler that publish their events to the index after each request."""

    def __init__(self, name: str, index: KVIndex, num_blocks: int = 12) -> None:
        self.name, self.index, self.log = name, index, KVEventLog()
        self.blocks = BlockManager(num_blocks, BS, enable_prefix_caching=True, events=self.log)
        self.scheduler = Scheduler(self.blocks, 8, 100)
        self.n = 0
        self.removed = 0  # blocks the pool gave up (reported as BlockRemoved)

    def run(self, tokens: list[int], lora: str | None = None) -> None:
        """Prefill `tokens` and finish (its cached blocks stay, evictable), then publish."""
        self.n += 1
        q = Sequence(f"{self.name}-{self.n}", list(tokens), SamplingParams(max_tokens=1), lora=lora)
        self.scheduler.add(q)
        out = self.scheduler.schedule()
        self.scheduler.computed(out)
        for x in out.scheduled:
            if x.samples:
                x.seq.output_token_ids.append(0)
        self.scheduler.finish(q, "length")
        batch = self.log.drain()
        self.removed += sum(len(e.block_hashes) for e in (batch.events if batch else ()) if isinstance(e, BlockRemoved))
        self.index.publish(self.name, [batch] if batch is not None else [])

    def truth(self, tokens: list[int], lora: str | None = None) -> tuple[list[bytes], int]:
        keys, run = self.blocks.cached_prefix(tokens, lora)
        return keys, len(run)


def test_the_index_says_what_each_pool_holds_through_stores_and_evictions() -> None:
    index, rng = KVIndex(), random.Random(7)
    replicas = [Replica("a", index), Replica("b", index)]
    stems = [[rng.randrange(50) for _ in range(8)] for _ in range(5)]  # shared prefixes: runs of two blocks
    for i in range(60):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        replicas[rng.randrange(2)].run(prompt, lora=rng.choice([None, None, "sql"]))
        for probe_stem in stems:
            for lora in (None, "sql"):
                probe = probe_stem + [1, 2, 3, 4, 5]
                keys, _ = replicas[0].truth(probe, lora)
                runs = index.prefix_runs(keys)
                for r in replicas:
                    assert runs.get(r.name, 0) == r.truth(probe, lora)[1], (i, r.name)
    # The pools are small: blocks were evicted, and the index followed (not only stores).
    assert all(r.removed > 0 for r in replicas)
    assert index.stats()["blocks"] <= 2 * 12


def test_a_removal_and_a_clear_take_blocks_out_per_tier() -> None:
    index = KVIndex()
    h = [bytes([i]) * 8 for i in range(3)]
    index.publish("a", [KVEventBatch(0.0, (BlockStored(tuple(h), None, (), BS, None),
                                           BlockStored(tuple(h[:1]), None, (), BS, None, medium="cpu")))])
    index.publish("b", [KVEventBatch(0.0, (BlockStored(tuple(h[:2]), None, (), BS, None),))])
    assert index.prefix_runs(h) == {"a": 3, "b": 2}
    index.publish("a", [KVEventBatch(1.0, (BlockRemoved((h[0],)),))])  # gone from the pool, kept on the host
    assert index.prefix_runs(h) == {"a": 3, "b": 2}  # any tier
    assert index.prefix_runs(h, tiers=["pool"]) == {"b": 2}  # the first block is not in a's pool
    index.publish("a", [KVEventBatch(2.0, (AllBlocksCleared(medium="cpu"),))])
    assert index.prefix_runs(h) == {"b": 2}
    assert index.replicas() == {"a": 2, "b": 2}  # a still holds blocks 1 and 2 in its pool
    index.publish("b", [KVEventBatch(3.0, (BlockRemoved((b"z" * 8,)),))])
    assert index.prefix_runs(h) == {"b": 2}  # removing a block b never held changes nothing


def test_a_replica_not_heard_from_is_forgotten_after_its_ttl() -> None:
    now = [0.0]
    index = KVIndex(ttl_s=5.0, clock=lambda: now[0])
    h = (b"x" * 8, b"y" * 8)
    index.publish("a", [KVEventBatch(0.0, (BlockStored(h, None, (), BS, None),))])
    index.publish("b", [KVEventBatch(0.0, (BlockStored(h, None, (), BS, None),))])
    now[0] = 4.0
    index.publish("b")  # a heartbeat: nothing new
    now[0] = 6.0
    assert index.prefix_runs(list(h)) == {"b": 2}  # a fell silent 6 s ago
    assert index.replicas() == {"b": 2}
    index.forget("b")  # a replica that restarts starts empty
    assert index.prefix_runs(list(h)) == {} and index.stats()["blocks"] == 0


def test_an_unknown_event_is_refused() -> None:
    with pytest.raises(TypeError, match="not a KV event"):
        KVIndex().publish("a", [KVEventBatch(0.0, ("stored",))])  # type: ignore[arg-type]


def test_lookup_hashes_the_prompt_as_each_replicas_engine_does() -> None:
    index = KVIndex()
    a, b = Replica("a", index), Replica("b", index)
    b.blocks.salt = b"another model"  # a replica of another model: the same tokens are other blocks
    for r in (a, b):
        index.publish(r.name, layout=(BS, r.blocks.salt.hex()))
    prompt = list(range(13))  # three full blocks
    a.run(prompt)
    b.run(prompt)
    a.run([7] * 9, lora="sql")
    assert index.lookup(prompt) == {"a": 3, "b": 3}  # each found under its own salt
    assert index.lookup(prompt[:9] + [99, 98, 97, 96]) == {"a": 2, "b": 2}
    assert index.lookup([7] * 9, lora="sql") == {"a": 2} and index.lookup([7] * 9) == {}
    index.forget("a")
    assert index.lookup(prompt) == {"b": 3}
