"""KV events of the block manager (model/engine/kv/events.py): what the pool made findable by hash
and what it gave up, in vLLM's event shapes, drained once per step. No torch."""

from __future__ import annotations

from model.engine.kv.block_manager import BlockManager
from model.engine.kv.events import BlockRemoved, BlockStored, KVEventLog
from model.engine.scheduler import Scheduler
from model.engine.sequence import Sequence
from model.sampling.params import SamplingParams

BS = 4


def step(s: Scheduler) -> None:
    """One step with a pretend model: computed tokens advance (blocks commit), samplers get token 0."""
    out = s.schedule()
    samplers = [x.seq for x in out.scheduled if x.samples]
    s.computed(out)
    for q in samplers:
        q.output_token_ids.append(0)


def run(s: Scheduler, rid: str, tokens: list[int], lora: str | None = None) -> Sequence:
    """Prefill `tokens` and finish the sequence (its cached blocks stay, evictable)."""
    q = Sequence(rid, list(tokens), SamplingParams(max_tokens=1), lora=lora)
    s.add(q)
    step(s)
    s.finish(q, "length")
    return q


def events_of(log: KVEventLog) -> list:
    batch = log.drain()
    return [] if batch is None else list(batch.events)


def test_a_prefill_reports_its_full_blocks_as_one_chain_and_a_shared_prefix_only_its_new_blocks() -> None:
    log = KVEventLog()
    bm = BlockManager(16, BS, enable_prefix_caching=True, events=log)
    s = Scheduler(bm, 8, 100)
    a = run(s, "a", list(range(10)))  # two full blocks (8 tokens) and a partial one
    [stored] = events_of(log)
    hashes = bm.hashes(a)
    assert stored == BlockStored(tuple(hashes[:2]), None, tuple(range(8)), BS, None)
    b = run(s, "b", list(range(8)) + [50, 51, 52, 53, 54])  # shares a's two blocks, adds a third
    [more] = events_of(log)
    assert more.block_hashes == (bm.hashes(b)[2],) and more.parent_block_hash == hashes[1]
    assert more.token_ids == (50, 51, 52, 53)
    assert log.drain() is None  # nothing new


def test_an_adapters_blocks_carry_its_name() -> None:
    log = KVEventLog()
    s = Scheduler(BlockManager(16, BS, enable_prefix_caching=True, events=log), 8, 100)
    run(s, "a", list(range(9)), lora="sql")
    [stored] = events_of(log)
    assert stored.lora_name == "sql" and len(stored.block_hashes) == 2


def test_a_cached_block_whose_memory_is_reused_is_reported_removed() -> None:
    log = KVEventLog()
    bm = BlockManager(3, BS, enable_prefix_caching=True, events=log)
    s = Scheduler(bm, 8, 100)
    a = run(s, "a", list(range(9)))  # blocks 0-1 cached, block 2 plain: all free after finish
    first = bm.hashes(a)
    events_of(log)
    run(s, "b", [90 + i for i in range(9)])  # needs all 3 blocks: a's two cached ones are evicted
    got = events_of(log)
    removed = [h for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(first[:2])
    assert [type(e) for e in got][-1] is BlockStored  # b's blocks, reported after the removals they needed


class Tier:
    """A second tier that keeps which hashes it was given (the BlockTier protocol)."""

    def __init__(self) -> None:
        self.saved: set[bytes] = set()

    def save(self, block: int, key: bytes) -> None:
        self.saved.add(key)

    def has(self, key: bytes) -> bool:
        return key in self.saved

    def load(self, key: bytes, block: int) -> bool:
        return True

    def publish(self, block: int, key: bytes) -> None:
        pass


def test_blocks_read_back_from_a_tier_are_reported_stored_in_the_pool_with_their_parents() -> None:
    log, tier = KVEventLog(), Tier()
    bm = BlockManager(3, BS, enable_prefix_caching=True, tier=tier, events=log)
    s = Scheduler(bm, 8, 100)
    a = run(s, "a", list(range(9)))
    run(s, "b", [90 + i for i in range(9)])  # a's blocks go to the tier
    events_of(log)
    again = Sequence("c", list(range(9)), SamplingParams(max_tokens=1))
    found = bm.match(again)
    assert len(found) == 2
    stored = [e for e in events_of(log) if isinstance(e, BlockStored)]
    hashes = bm.hashes(a)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        ((hashes[0],), None, ()), ((hashes[1],), hashes[0], ())]


def test_without_prefix_caching_or_a_log_nothing_is_reported() -> None:
    log = KVEventLog()
    s = Scheduler(BlockManager(16, BS, enable_prefix_caching=False, events=log), 8, 100)
    run(s, "a", list(range(12)))
    assert log.drain() is None
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    assert bm.events is None


def test_an_engine_hands_its_events_on_per_step_when_asked_to() -> None:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    engine = build_engine("transformer-base", EngineConfig(num_kv_blocks=32, block_size=BS,
                                                           enable_kv_cache_events=True), device="cpu")
    engine.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    batches = []
    while engine.has_unfinished():
        engine.step()
        batches.append(engine.drain_kv_events())
    stored = [e for b in batches if b is not None for e in b.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2, 1]  # the prompt's 2 full blocks; the 3rd filled by decode
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1] and stored[0].token_ids == tuple(range(1, 9))
    quiet = build_engine("transformer-base", EngineConfig(num_kv_blocks=32, block_size=BS), device="cpu")
    assert quiet.drain_kv_events() is None and quiet.scheduler.blocks.events is None
