"""Scheduler and block manager without torch: admission, token budget, preemption order, block accounting."""

from __future__ import annotations

import pytest

from model.engine.kv.block_manager import BlockManager, blocks_for
from model.engine.scheduler import Scheduler
from model.engine.sequence import SeqStatus, Sequence
from model.sampling.params import SamplingParams


def seq(rid: str, n_prompt: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and pretend the model ran: computed tokens advance, samplers get a token."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.seq.num_computed_tokens += s.num_new_tokens
        if samples:
            s.seq.output_token_ids.append(0)
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_block_manager_accounting() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = seq("a", 5), seq("b", 3)
    bm.grow(a, 5)
    assert len(a.block_table) == 2 and bm.num_free == 2 and bm.usage == 0.5
    assert not bm.can_grow(b, 9)
    bm.grow(b, 3)
    assert bm.num_free == 1
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.free(a)
    assert bm.num_free == 3 and a.block_table == [] and a.num_computed_tokens == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.grow(b, 100)


def test_admission_respects_token_budget_and_chunks_long_prompts() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(seq("long", 25))
    sched.add(seq("short", 3))
    assert run_step(sched) == [("long", 10)]
    assert run_step(sched) == [("long", 10)]
    # The last 5 prompt tokens of "long", then "short" fills the rest of the budget.
    assert run_step(sched) == [("long", 5), ("short", 3)]
    assert run_step(sched) == [("long", 1), ("short", 1)]


def test_decoding_sequences_keep_moving_during_a_long_prefill() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(seq("a", 2))
    run_step(sched)
    sched.add(seq("big", 40))
    for _ in range(3):
        steps = dict(run_step(sched))
        assert steps["a"] == 1 and steps["big"] == 7


def test_max_num_seqs_caps_the_batch() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq(str(i), 2))
    assert [r for r, _ in run_step(sched)] == ["0", "1"]
    assert len(sched.waiting) == 1


def test_admission_waits_for_free_blocks_in_order() -> None:
    sched = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(seq("a", 8))
    sched.add(seq("b", 8))
    sched.add(seq("c", 2))
    # "b" does not fit; "c" would, but must not jump the queue.
    assert run_step(sched) == [("a", 8)]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]


def test_preemption_takes_the_newest_running_sequence() -> None:
    sched = Scheduler(BlockManager(4, 2), max_num_seqs=8, max_num_batched_tokens=100)
    a, b = seq("a", 4), seq("b", 4)
    sched.add(a)
    sched.add(b)
    assert run_step(sched) == [("a", 4), ("b", 4)]  # pool full: 4 blocks of 2
    out = sched.schedule()  # "a" needs a 3rd block: "b" (newest) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    assert b.status == SeqStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    # When recomputed, "b" prefills its prompt and the token it had generated.
    assert b.num_uncomputed_tokens == 5


def test_finish_frees_blocks_of_running_and_waiting() -> None:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    a, b = seq("a", 6), seq("b", 6)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert bm.num_free == 8 and not sched.has_unfinished()
    assert a.status == SeqStatus.FINISHED and a.finish_reason == "abort"
