"""Prefix caching in the block manager and scheduler, without torch: hits, partial hits, misses,
eviction order, shared blocks outliving one owner, no double free, the pool back to all-free."""

from __future__ import annotations

import pytest

from model.engine.kv.block_manager import BlockManager, block_hashes
from model.engine.scheduler import Scheduler
from model.engine.sequence import SeqStatus, Sequence
from model.sampling.params import SamplingParams

BS = 4


def seq(rid: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def sched(num_blocks: int = 32, budget: int = 100, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=True), max_seqs, budget)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """One step with a pretend model: computed tokens advance (blocks commit), samplers get token 0."""
    out = s.schedule()
    samplers = [x.seq for x in out.scheduled if x.samples]
    s.computed(out)
    for q in samplers:
        q.output_token_ids.append(0)
    return [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled]


def prefill(s: Scheduler, q: Sequence) -> list[tuple[str, int]]:
    s.add(q)
    return run_step(s)


def test_hashes_chain_over_parents_and_salt() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2  # only full blocks
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert block_hashes([1, 2, 3, 4], BS, salt=b"other")[0] != a[0]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, start=a[:1]) == a


def test_full_hit_partial_hit_and_miss() -> None:
    s = sched()
    a = seq("a", list(range(12)))
    assert prefill(s, a) == [("a", 12)]
    # Same 12 tokens: 2 blocks found, the last block recomputed (its last token needs logits).
    b = seq("b", list(range(12)))
    assert prefill(s, b) == [("a", 1), ("b", 4)]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 8
    # Partial: the first block matches, the second differs.
    c = seq("c", list(range(4)) + [99] * 8)
    assert prefill(s, c)[-1] == ("c", 8) and c.num_cached_tokens == 4 and c.block_table[0] == a.block_table[0]
    # Miss: a different first token shares nothing, even though later blocks repeat a's tokens.
    d = seq("d", [7] + list(range(1, 12)))
    assert prefill(s, d)[-1] == ("d", 12) and d.num_cached_tokens == 0
    # A prompt shorter than a block never hits.
    e, f = seq("e", [1, 2, 3]), seq("f", [1, 2, 3])
    prefill(s, e)
    assert prefill(s, f)[-1] == ("f", 3) and f.num_cached_tokens == 0
    st = s.blocks.stats
    assert (st.queries, st.hits) == (12 * 4 + 3 + 3, 8 + 4)


def test_shared_blocks_survive_one_owners_abort_and_the_pool_returns_to_all_free() -> None:
    s = sched(num_blocks=16)
    a, b = seq("a", list(range(10))), seq("b", list(range(10)))
    prefill(s, a)
    prefill(s, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    s.finish(a, "abort")
    assert s.blocks.num_free == 16 - len(b.block_table)  # b still holds the shared blocks
    c = seq("c", list(range(10)))
    prefill(s, c)
    assert c.block_table[:2] == shared and c.num_cached_tokens == 8
    s.finish(b, "abort")
    s.finish(c, "stop")
    assert s.blocks.num_free == 16 and s.blocks.usage == 0.0
    with pytest.raises(RuntimeError, match="freed twice"):
        c.block_table = list(shared)
        s.blocks.free(c)


def test_eviction_is_lru_and_takes_the_tail_of_a_chain_first() -> None:
    s = sched(num_blocks=6)
    old, new = seq("old", list(range(100, 109))), seq("new", list(range(200, 209)))
    prefill(s, old)
    s.finish(old, "stop")
    prefill(s, new)
    s.finish(new, "stop")
    assert s.blocks.num_cached == 4 and s.blocks.num_free == 6
    # Needs 5 blocks: the 2 plain free ones, then the old chain's tail, then its head, then new's tail.
    big = seq("big", list(range(300, 317)))
    old_head, old_tail = [s.blocks._cached[h] for h in old.block_hashes]
    new_head, new_tail = [s.blocks._cached[h] for h in new.block_hashes]
    prefill(s, big)
    assert big.block_table[2:5] == [old_tail, old_head, new_tail]
    cached = s.blocks._cached
    assert [h in cached for h in old.block_hashes + new.block_hashes] == [False, False, True, False]
    assert cached[new.block_hashes[0]] == new_head
    # "new"'s head is still there: its first block hits, the old chain is gone.
    s.finish(big, "stop")
    again = seq("again", list(range(200, 209)))
    prefill(s, again)
    assert again.num_cached_tokens == 4


def test_a_block_being_written_is_never_shared_and_a_sibling_waits_for_it() -> None:
    # Chunked prefill: "a" computes 16 prompt tokens over two steps of 8; "b" (same prompt,
    # as an n > 1 sibling) waits instead of computing the same blocks, then shares all of them.
    s = sched(budget=8)
    a, b = seq("a", list(range(16))), seq("b", list(range(16)))
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 8)]
    assert b.status == SeqStatus.WAITING and b.block_table == []
    assert run_step(s) == [("a", 8)]
    assert run_step(s) == [("a", 1), ("b", 4)]
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == 12
    # An unrelated request behind the waiting sibling is not held up.
    c, d, e = seq("c", list(range(16))), seq("d", list(range(16))), seq("e", [5, 6])
    s2 = sched(budget=40)
    for q in (c, d, e):
        s2.add(q)
    assert run_step(s2) == [("c", 16), ("e", 2)]
    assert run_step(s2) == [("c", 1), ("e", 1), ("d", 4)]


def test_a_preempted_sequence_reuses_its_own_cached_blocks() -> None:
    s = sched(num_blocks=4)
    a, b = seq("a", list(range(8)), max_tokens=8), seq("b", list(range(50, 58)), max_tokens=8)
    s.add(a)
    s.add(b)
    assert run_step(s) == [("a", 8), ("b", 8)]  # pool full
    out = s.schedule()  # "a" needs a third block: "b" is preempted, its 2 full blocks stay cached
    assert [q.request_id for q in out.preempted] == ["b"]
    s.computed(out)
    a.output_token_ids.append(0)
    s.finish(a, "stop")
    # "b" comes back with prompt + 1 generated token = 9 tokens: its own head block is found.
    assert run_step(s) == [("b", 5)]
    assert b.num_computed_tokens == 9 and b.num_cached_tokens == 0  # cached_tokens counts the first admission
    s.finish(b, "stop")
    assert s.blocks.num_free == 4


def test_caching_off_shares_nothing() -> None:
    s = Scheduler(BlockManager(16, BS), 8, 100)
    a, b = seq("a", list(range(12))), seq("b", list(range(12)))
    s.add(a)
    run_step(s)
    s.add(b)
    assert run_step(s)[-1] == ("b", 12)
    assert set(a.block_table).isdisjoint(b.block_table) and s.blocks.num_cached == 0
