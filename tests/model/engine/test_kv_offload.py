"""The prefix cache's offload tier (model/engine/kv/offload.py): blocks evicted from the pool come
back from host memory or a disk file instead of being recomputed, and outputs never change: greedy
and seeded tokens with the tier on equal those with prefix caching off, alone, batched and under
preemption; a block that does not read back (a corrupt file) or could not be written (a full disk)
is recomputed, never used."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.kv.block_manager import BlockManager
from model.engine.kv.events import KVEventLog
from model.engine.kv.offload import DiskStore, KVOffload
from model.engine.scheduler import Scheduler
from model.engine.sequence import Sequence
from tests.model.engine.test_kv_events import events_of
from tests.model.engine.test_prefix_cache import run_step

BS = 4
MODEL = "transformer-base"


# ---- the block manager with a tier, no torch ----------------------------------------------------

class DictTier:
    """A tier that keeps (block -> key) records: what the block manager asked of it."""

    def __init__(self, fail_load: bool = False) -> None:
        self.saved: dict[bytes, int] = {}
        self.loads: list[tuple[bytes, int]] = []
        self.fail_load = fail_load

    def save(self, block: int, key: bytes) -> None:
        self.saved[key] = block

    def has(self, key: bytes) -> bool:
        return key in self.saved

    def load(self, key: bytes, block: int) -> bool:
        self.loads.append((key, block))
        return not self.fail_load

    def publish(self, block: int, key: bytes) -> None:
        pass


def sched(tier: DictTier, num_blocks: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=True, tier=tier), 8, 100)


def finish(s: Scheduler, q: Sequence) -> None:
    s.finish(q, "length")


def test_an_evicted_cached_block_is_saved_and_a_later_prefix_comes_back_from_the_tier() -> None:
    tier = DictTier()
    s = sched(tier, num_blocks=4)
    a = Sequence("a", list(range(12)), SamplingParams(max_tokens=1))
    s.add(a)
    run_step(s)
    finish(s, a)  # its 3 blocks stay cached, evictable
    b = Sequence("b", [50 + i for i in range(12)], SamplingParams(max_tokens=1))
    s.add(b)
    run_step(s)  # b's 3 blocks take the free one, then evict 2 of a's (least recently used: a's tail first)
    finish(s, b)
    assert len(tier.saved) == 2
    c = Sequence("c", list(range(12)) + [99], SamplingParams(max_tokens=1))
    s.add(c)
    assert run_step(s) == [("c", 1)]  # 12 tokens found: a's head in the pool, the rest from the tier
    assert c.num_cached_tokens == 12 and len(tier.loads) == 2
    assert s.blocks.stats.hits == 12


def test_a_block_that_does_not_load_is_computed_and_its_pool_block_is_free_again() -> None:
    tier = DictTier(fail_load=True)
    s = sched(tier, num_blocks=4)
    for rid, base in (("a", 0), ("b", 50)):
        q = Sequence(rid, [base + i for i in range(12)], SamplingParams(max_tokens=1))
        s.add(q)
        run_step(s)
        finish(s, q)
    c = Sequence("c", list(range(12)) + [99], SamplingParams(max_tokens=1))
    s.add(c)
    assert run_step(s) == [("c", 13 - c.num_cached_tokens)] and c.num_cached_tokens == 4
    assert len(tier.loads) == 1  # the first failure ends the run: the rest is computed
    finish(s, c)
    assert s.blocks.num_free == 4


def test_loading_never_evicts_the_prefix_it_is_extending() -> None:
    """With every pool block evictable and part of the prompt's own prefix, the tier's blocks are
    not loaded over them: the run stops where the pool has no other block to give."""
    tier = DictTier()
    bm = BlockManager(2, BS, enable_prefix_caching=True, tier=tier)
    s = Scheduler(bm, 8, 100)
    q = Sequence("q", list(range(8)), SamplingParams(max_tokens=1))
    s.add(q)
    run_step(s)
    finish(s, q)  # the pool's 2 blocks hold tokens 0..7, both evictable
    longer = Sequence("y", list(range(12)) + [0], SamplingParams(max_tokens=1))
    tier.saved[bm.hashes(longer)[2]] = -1  # the tier holds the third block
    assert bm.match(longer) == q_blocks(bm, longer, 2) and tier.loads == []


def q_blocks(bm: BlockManager, seq: Sequence, n: int) -> list[int]:
    return [bm._cached[h] for h in bm.hashes(seq)[:n]]


# ---- the engine: exact outputs with the tier ------------------------------------------------

def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Four 80-token system prompts, each asked twice with its own tail; a pool of 12 blocks holds
    one prompt at a time (85 + 16 tokens: 7 blocks), so every second ask finds its prefix evicted
    from the pool, and two at once must preempt."""
    rng = random.Random(3)
    systems = [[rng.randrange(256) for _ in range(80)] for _ in range(4)]
    prompts, params = [], []
    for round_ in range(2):
        for i, system in enumerate(systems):
            prompts.append(system + [rng.randrange(256) for _ in range(5)])
            params.append(SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                                         seed=10 * round_ + i))
    return prompts, params


@pytest.fixture(scope="module")
def reference() -> list:
    prompts, params = workload()
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, enable_prefix_caching=False))
    return [o.token_ids for o in (llm.generate([p], [sp])[0] for p, sp in zip(prompts, params))]


def run_one_by_one(llm: LLM) -> list[list[int]]:
    prompts, params = workload()
    return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("where", ["host", "disk"])
def test_one_by_one_the_tier_serves_evicted_prefixes_with_the_same_tokens(reference, where, tmp_path) -> None:
    cfg = EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                       kv_offload_dir=str(tmp_path) if where == "disk" else None)
    llm = LLM(MODEL, engine_config=cfg)
    assert run_one_by_one(llm) == reference
    stats = llm.engine.stats()
    # the second ask of each system prompt: 5 full blocks of 80 tokens, from the pool or the tier
    assert stats.kv_offload_loaded_blocks >= 3 * 5 and stats.kv_offload_errors == 0
    assert stats.kv_offload_bytes_read == stats.kv_offload_loaded_blocks * llm.engine.kv_offload.block_nbytes
    assert stats.prefix_cache_hits >= 4 * 80
    if where == "disk":
        assert os.listdir(tmp_path) == []  # the file is unlinked at once
    llm.engine.kv_offload.flush()
    assert llm.engine.stats().kv_offload_saved_blocks > 0
    llm.shutdown()


def test_batched_and_preempted_with_the_tier_gives_the_same_tokens(reference, tmp_path) -> None:
    prompts, params = workload()
    # all eight at once in 12 blocks: preemption is forced, and evicted prefixes go to the tier
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                                                kv_offload_dir=str(tmp_path)))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.kv_offload_loaded_blocks > 0
    assert stats.num_free_blocks == 12


def test_a_corrupt_block_on_disk_is_recomputed_never_used(reference, tmp_path) -> None:
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                                                kv_offload_dir=str(tmp_path)))
    prompts, params = workload()
    for p, sp in zip(prompts[:4], params[:4]):  # the first asks fill the tier
        llm.generate([p], [sp])
    tier = llm.engine.kv_offload
    tier.flush()
    written = sorted(tier._index.values())
    assert written
    garbage = b"\x7f" * tier.block_nbytes
    for slot in written:  # every stored block changed underneath the tier
        os.pwrite(tier.store.fd, garbage, slot * tier.block_nbytes)
    got = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts[4:], params[4:])]
    assert got == reference[4:]
    stats = llm.engine.stats()
    # the first corrupt block of each prefix is caught (the lookup stops there); blocks saved
    # after the corruption load as written
    assert stats.kv_offload_errors > 0


def test_a_full_disk_drops_blocks_and_changes_no_token(reference, tmp_path, monkeypatch) -> None:
    """A write that fails (ENOSPC, raised by pwrite's stand-in: a disk cannot be filled safely
    here) leaves the block out of the tier; its tokens are recomputed."""
    def full(self, slot, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "write", full)
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                                                kv_offload_dir=str(tmp_path)))
    assert run_one_by_one(llm) == reference
    llm.engine.kv_offload.flush()
    stats = llm.engine.stats()
    assert stats.kv_offload_errors > 0 and stats.kv_offload_saved_blocks == 0
    assert stats.kv_offload_bytes_written == 0


def test_a_writer_that_falls_behind_skips_blocks_and_changes_no_token(reference, tmp_path, monkeypatch) -> None:
    """A writer held up (a slow disk: every write waits on a gate here) does not hold up the step:
    past MAX_PENDING blocks queued, evicted blocks are skipped, and the blocks still queued are
    read from their copies."""
    from model.engine.kv import offload as kv_offload

    gate, real = threading.Event(), DiskStore.write

    def slow(self, slot, data):
        gate.wait(60)
        real(self, slot, data)

    monkeypatch.setattr(DiskStore, "write", slow)
    monkeypatch.setattr(kv_offload, "MAX_PENDING", 4)
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                                                kv_offload_dir=str(tmp_path)))
    try:
        got = run_one_by_one(llm)
    finally:
        gate.set()
    assert got == reference
    llm.engine.kv_offload.flush()
    stats = llm.engine.stats()
    assert stats.kv_offload_skipped_blocks > 0
    assert stats.kv_offload_saved_blocks <= 4 + 1  # the queue's 4 and the one being written


@pytest.mark.parametrize("fields, message", [
    ({"kv_offload_dir": "/tmp/x"}, "kv_offload_dir needs kv_offload_bytes > 0"),
    ({"kv_offload_bytes": -1}, "kv_offload_bytes must be an integer >= 0, got -1"),
    ({"kv_offload_bytes": 1 << 20, "enable_prefix_caching": False}, "kv_offload_bytes needs enable_prefix_caching"),
    ({"kv_offload_bytes": 1 << 20, "tensor_parallel_size": 2}, "kv_offload_bytes is not supported with tensor_parallel"),
])
def test_bad_settings_are_refused_with_what_is_allowed(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_a_tier_smaller_than_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=4, kv_offload_bytes=1024))


def test_the_service_exports_the_tiers_totals_as_counters(reference, tmp_path) -> None:
    """service/engine/metrics.py: each qkv_kv_offload_* counter gets what the engine's totals
    added since the last refresh (Ray's metric objects, their inc recorded)."""
    from service.engine.metrics import EngineMetrics
    from tests.support.in_process import recorded_counters

    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20))
    run_one_by_one(llm)
    llm.engine.kv_offload.flush()
    st = llm.engine.stats()
    metrics = EngineMetrics("tiny")
    calls = recorded_counters(metrics, {
        "offload_saved": "qkv_kv_offload_saved_blocks_total", "offload_loaded": "qkv_kv_offload_loaded_blocks_total",
        "offload_written": "qkv_kv_offload_bytes_written_total", "offload_read": "qkv_kv_offload_bytes_read_total",
        "offload_load_time": "qkv_kv_offload_load_seconds_total", "offload_errors": "qkv_kv_offload_errors_total"})
    metrics.refresh(st)
    metrics.refresh(st)  # nothing new: no increment
    assert calls["offload_loaded"] == [st.kv_offload_loaded_blocks] and calls["offload_saved"] == [st.kv_offload_saved_blocks]
    assert calls["offload_read"] == [st.kv_offload_bytes_read] and calls["offload_load_time"] == [st.kv_offload_load_seconds]
    assert "offload_errors" not in calls  # no error, no increment


def test_the_app_takes_the_tier_and_refuses_a_directory_without_a_size(tmp_path) -> None:
    from service.app import AppArgs, engine_options

    args = AppArgs(kv_offload_bytes=1 << 30, kv_offload_dir=str(tmp_path))
    assert EngineConfig(**args.engine_config()).kv_offload_dir == str(tmp_path)
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_offload_bytes > 0"):
        engine_options(AppArgs(kv_offload_dir=str(tmp_path)))


# ---- what the tier reports and exports (KV events, a peer's prefix fetch) ----------------------

def events_by(log: KVEventLog) -> list[tuple[str, str, tuple[bytes, ...]]]:
    """The drained events as (kind, medium, hashes)."""
    return [(type(e).__name__, e.medium, e.block_hashes) for e in events_of(log)]


@pytest.mark.parametrize("where", ["host", "disk"])
def test_with_kv_events_the_tier_reports_the_blocks_it_stores_evicts_and_drops(where, tmp_path) -> None:
    log = KVEventLog()
    pool = [torch.arange(4 * 8, dtype=torch.float32).view(4, 8)]  # 4 blocks of 32 bytes
    tier = KVOffload(pool, 2 * 32, str(tmp_path) if where == "disk" else None, log, block_size=BS)
    tier.save(0, b"a")
    tier.save(1, b"b")
    tier.save(1, b"b")  # already held: nothing new to report
    tier.save(2, b"c")  # two slots: a, the least recently used, makes room
    tier.flush()
    assert events_by(log) == [("BlockStored", where, (b"a",)), ("BlockStored", where, (b"b",)),
                              ("BlockRemoved", where, (b"a",)), ("BlockStored", where, (b"c",))]

    def fail(slot, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    tier.store.write = fail  # the next write fails: the block is dropped, and says so
    tier.save(3, b"d")
    tier.flush()
    assert events_by(log) == [("BlockRemoved", where, (b"b",)), ("BlockStored", where, (b"d",)),
                              ("BlockRemoved", where, (b"d",))]
    assert not tier.has(b"d") and tier.read(b"c") is not None
    tier.close()


def test_an_engine_reports_its_tiers_blocks_and_exports_them_as_the_pool_held_them() -> None:
    """A prefix pushed out of the pool into the host tier: the events say it left the pool and is in
    the tier, the engine counts it as held, and a peer's export of it is the bytes the pool had."""
    prompts, _ = workload()
    greedy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    llm = LLM(MODEL, engine_config=EngineConfig(num_kv_blocks=12, kv_offload_bytes=64 << 20,
                                                enable_kv_cache_events=True))
    first = prompts[0]
    llm.generate([first], [greedy])
    in_pool = llm.engine.export_prefix(first)
    assert len(in_pool.keys) == 5  # 85 tokens: 5 full blocks
    llm.engine.drain_kv_events()
    llm.generate(prompts[1:4], [greedy] * 3)  # three other system prompts: the pool's 12 blocks turn over
    llm.engine.kv_offload.flush()
    batch = llm.engine.drain_kv_events()
    by_medium: dict[tuple[str, str], set[bytes]] = {}
    for e in batch.events:
        by_medium.setdefault((type(e).__name__, e.medium), set()).update(e.block_hashes)
    keys = set(in_pool.keys)
    assert keys <= by_medium[("BlockRemoved", "pool")] and keys <= by_medium[("BlockStored", "host")]
    assert llm.engine.scheduler.blocks.cached_prefix(first)[1] == []  # none left in the pool
    assert llm.engine.cached_prefix_blocks(first) == (5, 5)  # the tier's run counts as held
    from_tier = llm.engine.export_prefix(first)
    assert from_tier.keys == in_pool.keys and torch.equal(from_tier.data, in_pool.data)
    llm.shutdown()
