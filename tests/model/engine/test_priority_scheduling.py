"""Priority scheduling with aging and per-tenant fairness (issue 40): admission order, preemption
for a better request, no starvation, equal priorities as plain FCFS, and outputs that do not
depend on any of it (preemption recomputes)."""

from __future__ import annotations

import functools
import random

import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.kv.block_manager import BlockManager
from model.engine.scheduler import Scheduler
from model.engine.sequence import LOWEST_PRIORITY, SeqStatus, Sequence
from tests.model.engine import test_prefix_cache as prefix_cache_tests
from tests.model.engine import test_scheduler as fcfs_scheduler_tests

MODEL = "transformer-base"


class Clock:
    """A settable time.monotonic() for the scheduler: aging is driven without sleeping."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def seq(rid: str, n_prompt: int, priority: int = 0, arrival: float = 0.0, tenant: str | None = None,
        max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(n_prompt)), SamplingParams(max_tokens=max_tokens), priority=priority,
                    tenant=tenant, arrival_time=arrival)


def sched(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, policy: str = "priority",
          aging: float = 10.0, clock: Clock | None = None, lowest_max: int | None = None) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, 100, policy=policy, priority_aging_s=aging,
                     clock=clock or Clock(), lowest_priority_max_seqs=lowest_max)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and pretend the model ran (as tests/model/engine/test_scheduler.py's run_step)."""
    return fcfs_scheduler_tests.run_step(s)


# ---- admission order --------------------------------------------------------------------------

def test_a_high_priority_request_is_admitted_before_earlier_low_ones() -> None:
    s = sched(max_seqs=2)
    for q in (seq("low0", 4, priority=5, arrival=0.0), seq("low1", 4, priority=5, arrival=1.0),
              seq("high", 4, priority=-1, arrival=2.0)):
        s.add(q)
    assert run_step(s) == [("high", 4), ("low0", 4)]
    assert [q.request_id for q in s.waiting] == ["low1"]
    # The same queue under fcfs ignores priorities: arrival order.
    f = sched(max_seqs=2, policy="fcfs")
    for q in (seq("low0", 4, priority=5, arrival=0.0), seq("low1", 4, priority=5, arrival=1.0),
              seq("high", 4, priority=-1, arrival=2.0)):
        f.add(q)
    assert run_step(f) == [("low0", 4), ("low1", 4)]


def test_the_best_waiting_request_that_does_not_fit_holds_back_worse_ones() -> None:
    # "high" needs 3 blocks, 2 are free and nothing running is worse: it waits, and the
    # low-priority request behind it, which would fit, does not jump ahead.
    s = sched(num_blocks=4, block_size=4)
    s.add(seq("first", 8, priority=0, arrival=0.0))
    assert run_step(s) == [("first", 8)]
    s.add(seq("high", 12, priority=0, arrival=1.0))
    s.add(seq("low", 2, priority=3, arrival=2.0))
    out = s.schedule()
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("first", 1)]
    assert not out.preempted and [q.request_id for q in s.waiting] == ["high", "low"]


# ---- preemption ---------------------------------------------------------------------------------

def full_pool(priorities: tuple[int, int]) -> tuple[Scheduler, Sequence, Sequence]:
    """Two running sequences of 3 prompt tokens holding all 4 blocks of 2 (a decode step still fits)."""
    s = sched(num_blocks=4, block_size=2)
    a, b = seq("a", 3, priority=priorities[0], arrival=0.0), seq("b", 3, priority=priorities[1], arrival=1.0)
    s.add(a)
    s.add(b)
    assert sorted(run_step(s)) == [("a", 3), ("b", 3)] and s.blocks.num_free == 0
    return s, a, b


def test_a_better_arrival_preempts_the_worst_running_sequence_for_blocks() -> None:
    s, a, b = full_pool((1, 1))
    s.add(seq("high", 2, priority=0, arrival=2.0))
    out = s.schedule()
    # Of equals, the latest arrival is preempted; its decode step scheduled before is dropped.
    assert [q.request_id for q in out.preempted] == ["b"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("high", 2)]
    assert b.status == SeqStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.arrival_time == 1.0 and b.num_preemptions == 1 and list(s.waiting) == [b]


def test_preemption_goes_worst_first_until_the_request_fits() -> None:
    s, a, b = full_pool((2, 1))  # "a" is worse although older
    s.add(seq("high", 2, priority=0, arrival=2.0))
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["a"]  # one is enough: "b" keeps running
    assert [x.seq.request_id for x in out.scheduled] == ["b", "high"]
    s2, a2, b2 = full_pool((2, 1))
    s2.add(seq("big", 7, priority=0, arrival=2.0))  # needs all 4 blocks: both go, the worst first
    out = s2.schedule()
    assert [q.request_id for q in out.preempted] == ["a", "b"]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("big", 7)]


def test_an_equal_or_better_running_sequence_is_never_preempted_for_a_waiting_one() -> None:
    s, a, b = full_pool((0, 1))
    s.add(seq("equal", 2, priority=1, arrival=2.0))
    out = s.schedule()
    assert not out.preempted and [x.seq.request_id for x in out.scheduled] == ["a", "b"]
    # Preempting the only worse one ("b", 2 blocks) would not make room for 3 blocks: none is.
    s2, a2, b2 = full_pool((0, 1))
    s2.add(seq("too-big", 6, priority=0, arrival=2.0))
    out = s2.schedule()
    assert not out.preempted and b2.status == SeqStatus.RUNNING


def test_a_better_arrival_preempts_for_a_sequence_slot() -> None:
    s = sched(max_seqs=1)
    low = seq("low", 2, priority=1, arrival=0.0)
    s.add(low)
    run_step(s)
    s.add(seq("high", 2, priority=0, arrival=1.0))
    out = s.schedule()
    assert out.preempted == [low] and [x.seq.request_id for x in out.scheduled] == ["high"]


def test_a_running_sequence_short_of_blocks_preempts_the_worst_not_the_newest() -> None:
    s = sched(num_blocks=4, block_size=2)
    low, high = seq("low", 3, priority=3, arrival=0.0), seq("high", 3, priority=0, arrival=1.0)
    s.add(low)
    assert run_step(s) == [("low", 3)]
    s.add(high)
    assert run_step(s) == [("low", 1), ("high", 3)]  # the pool is full; "high" is the newest
    out = s.schedule()  # "low" needs a third block: it is the worst, so it goes, not "high"
    assert out.preempted == [low]
    assert [(x.seq.request_id, x.num_new_tokens) for x in out.scheduled] == [("high", 1)]


# ---- equal priorities: exactly fcfs --------------------------------------------------------------

FCFS_TESTS = [
    (fcfs_scheduler_tests, "test_admission_respects_token_budget_and_chunks_long_prompts"),
    (fcfs_scheduler_tests, "test_decoding_sequences_keep_moving_during_a_long_prefill"),
    (fcfs_scheduler_tests, "test_max_num_seqs_caps_the_batch"),
    (fcfs_scheduler_tests, "test_admission_waits_for_free_blocks_in_order"),
    (fcfs_scheduler_tests, "test_preemption_takes_the_newest_running_sequence"),
    (fcfs_scheduler_tests, "test_finish_frees_blocks_of_running_and_waiting"),
    (prefix_cache_tests, "test_full_hit_partial_hit_and_miss"),
    (prefix_cache_tests, "test_a_block_being_written_is_never_shared_and_a_sibling_waits_for_it"),
    (prefix_cache_tests, "test_a_preempted_sequence_reuses_its_own_cached_blocks"),
]


@pytest.mark.parametrize("module, name", FCFS_TESTS, ids=[name for _, name in FCFS_TESTS])
def test_equal_priorities_schedule_exactly_as_fcfs(module, name, monkeypatch) -> None:
    """The fcfs scheduler tests (FIFO admission, no jumping ahead, the newest preempted, siblings
    waiting for a prefix being written) pass unchanged under the priority policy."""
    monkeypatch.setattr(module, "Scheduler", functools.partial(Scheduler, policy="priority"))
    assert module.Scheduler(BlockManager(4, 4), 1, 16).by_priority
    getattr(module, name)()


# ---- aging --------------------------------------------------------------------------------------

@pytest.mark.parametrize("aging", [10.0, 0.0])
def test_aging_admits_a_preempted_low_request_ahead_of_a_stream_of_high_ones(aging) -> None:
    clock = Clock(0.0)
    s = sched(max_seqs=1, aging=aging, clock=clock)
    low = seq("low", 2, priority=2, arrival=0.0, max_tokens=1000)
    s.add(low)
    assert run_step(s) == [("low", 2)]
    admitted, preempted_at = [], []
    for t in range(1, 40):  # one high request a second, each done after one step
        clock.t = float(t)
        s.add(seq(f"h{t}", 2, priority=0, arrival=float(t)))
        out = s.schedule()
        s.computed(out)
        preempted_at += [t for q in out.preempted if q is low]
        admitted += [t for x in out.scheduled if x.seq is low and x.num_new_tokens > 1]
        for q in list(s.running):
            if q is not low:
                s.finish(q, "stop")
    assert preempted_at == [1]  # a better arrival preempts it once ...
    if aging:
        # ... and 2 aging periods after it *arrived* (not after it was preempted) it ties with
        # every new high request and wins on arrival; then none of them preempts it again.
        assert admitted == [20] and low.status == SeqStatus.RUNNING
        assert s.effective_priority(low, 25.0) == 0 and s.effective_priority(low, 30.0) == -1
    else:
        assert admitted == [] and low.status == SeqStatus.WAITING  # starved without aging


# ---- tenants ------------------------------------------------------------------------------------

def test_fcfs_admits_a_quiet_tenants_request_before_a_flooding_tenants_queue() -> None:
    s = sched(max_seqs=2, policy="fcfs")
    flood = [seq(f"a{i}", 2, tenant="A", arrival=float(i)) for i in range(4)]
    for q in flood:
        s.add(q)
    assert run_step(s) == [("a0", 2), ("a1", 2)]
    s.add(seq("b0", 2, tenant="B", arrival=10.0))
    s.finish(flood[0], "stop")
    assert [r for r, _ in run_step(s)] == ["a1", "b0"]  # not a2, queued long before
    assert [q.request_id for q in s.waiting] == ["a2", "a3"]


def test_fcfs_interleaves_tenants_as_their_running_counts_grow() -> None:
    s = sched(max_seqs=4, policy="fcfs")
    for q in (seq("a0", 2, tenant="A"), seq("a1", 2, tenant="A"), seq("a2", 2, tenant="A"),
              seq("n0", 2), seq("b0", 2, tenant="B")):
        s.add(q)
    # Each admission raises its tenant's count; None is a group of its own.
    assert [r for r, _ in run_step(s)] == ["a0", "n0", "b0", "a1"]


def test_without_tenants_fcfs_keeps_its_queue_order() -> None:
    s = sched(max_seqs=3, policy="fcfs")
    for i in range(5):
        s.add(seq(f"r{i}", 2, priority=0, arrival=float(10 - i)))  # arrival times play no part in fcfs
    assert [r for r, _ in run_step(s)] == ["r0", "r1", "r2"]
    assert [q.request_id for q in s.waiting] == ["r3", "r4"]


def test_priority_comes_before_tenant_load_and_load_before_arrival() -> None:
    s = sched(max_seqs=3)
    s.add(seq("a0", 2, priority=0, tenant="A", arrival=0.0))
    run_step(s)
    for q in (seq("a1", 2, priority=0, tenant="A", arrival=1.0), seq("b-low", 2, priority=1, tenant="B", arrival=2.0),
              seq("c0", 2, priority=0, tenant="C", arrival=3.0)):
        s.add(q)
    # c0 and a1 share the best priority: C has nothing running, A has a0; b-low is worse.
    assert [r for r, _ in run_step(s)] == ["a0", "c0", "a1"]
    assert [q.request_id for q in s.waiting] == ["b-low"]


# ---- the lowest priority beside the others (lowest_priority_max_seqs) -----------------------------

def test_lowest_priority_sequences_alone_use_the_whole_engine() -> None:
    s = sched(max_seqs=4, lowest_max=1)
    for i in range(3):
        s.add(seq(f"b{i}", 4, priority=LOWEST_PRIORITY, arrival=float(i)))
    assert run_step(s) == [("b0", 4), ("b1", 4), ("b2", 4)]  # no other request: no limit
    assert run_step(s) == [("b0", 1), ("b1", 1), ("b2", 1)]


def test_beside_an_interactive_request_lowest_priority_sequences_pause_keeping_their_blocks() -> None:
    s = sched(max_seqs=4, lowest_max=1)
    for i in range(3):
        s.add(seq(f"b{i}", 4, priority=LOWEST_PRIORITY, arrival=float(i)))
    run_step(s)
    tables = {q.request_id: list(q.block_table) for q in s.running}
    s.add(seq("chat", 4, priority=0, arrival=5.0))
    # The interactive prompt and one batch row run; the two others sit the step out, not preempted.
    assert run_step(s) == [("b0", 1), ("chat", 4)]
    assert run_step(s) == [("chat", 1), ("b0", 1)]
    paused = [q for q in s.running if q.request_id in ("b1", "b2")]
    assert [q.status for q in paused] == [SeqStatus.RUNNING] * 2 and s.num_preemptions == 0
    assert {q.request_id: list(q.block_table) for q in paused} == {k: tables[k] for k in ("b1", "b2")}
    s.finish(next(q for q in s.running if q.request_id == "chat"), "stop")
    assert run_step(s) == [("b0", 1), ("b1", 1), ("b2", 1)]  # the interactive one is done: all go on


def test_a_waiting_lowest_priority_sequence_is_not_admitted_past_the_limit_but_others_are() -> None:
    s = sched(max_seqs=4, lowest_max=1)
    s.add(seq("chat", 4, priority=0, arrival=0.0))
    s.add(seq("b0", 4, priority=LOWEST_PRIORITY, arrival=1.0))
    s.add(seq("b1", 4, priority=LOWEST_PRIORITY, arrival=2.0))
    s.add(seq("late", 4, priority=3, arrival=3.0))
    assert run_step(s) == [("chat", 4), ("late", 4), ("b0", 4)]
    assert [q.request_id for q in s.waiting] == ["b1"]
    with pytest.raises(ValueError, match="needs scheduling_policy 'priority'"):
        EngineConfig(lowest_priority_max_seqs=1)
    with pytest.raises(ValueError, match="an integer >= 0 or None"):
        EngineConfig(scheduling_policy="priority", lowest_priority_max_seqs=-1)


def test_paused_lowest_priority_sequences_generate_the_tokens_they_would_have() -> None:
    prompts = [[1 + i, 2, 3, 4 + i] for i in range(6)]
    priorities = [LOWEST_PRIORITY, 0, LOWEST_PRIORITY, LOWEST_PRIORITY, 2, LOWEST_PRIORITY]
    ref = LLM(MODEL, num_kv_blocks=64).generate(prompts, greedy(6))
    capped = LLM(MODEL, scheduling_policy="priority", lowest_priority_max_seqs=1, max_num_seqs=6, num_kv_blocks=64)
    outs = capped.generate(prompts, greedy(6), priority=priorities)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert capped.engine.scheduler.num_preemptions == 0


def test_the_engine_counts_its_lowest_priority_sequences_apart() -> None:
    """EngineStats' num_running_lowest / num_waiting_lowest: the Batch API's sequences among the
    running and waiting ones (the metric qkv_num_requests_by_priority splits the gauges by them)."""
    llm = LLM(MODEL, scheduling_policy="priority", max_num_seqs=2, num_kv_blocks=32)
    engine = llm.engine
    for i, priority in enumerate((LOWEST_PRIORITY, 0, LOWEST_PRIORITY, 3)):
        engine.add_request(f"r{i}", [1 + i, 2, 3], greedy(4), priority=priority)
    st = engine.stats()
    assert (st.num_running, st.num_waiting, st.num_running_lowest, st.num_waiting_lowest) == (0, 4, 0, 2)
    engine.step()  # two slots: the interactive ones run, the batch's wait
    st = engine.stats()
    assert (st.num_running, st.num_waiting, st.num_running_lowest, st.num_waiting_lowest) == (2, 2, 0, 2)
    while engine.has_unfinished():
        engine.step()
    st = engine.stats()
    assert (st.num_running, st.num_waiting, st.num_running_lowest, st.num_waiting_lowest) == (0, 0, 0, 0)


# ---- configuration and the engine's contract ------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"scheduling_policy": "lifo"}, "scheduling_policy must be one of fcfs, priority; got 'lifo'"),
    ({"priority_aging_s": -1.0}, "priority_aging_s must be a number of seconds >= 0"),
    ({"priority_aging_s": float("nan")}, "priority_aging_s must be"),
])
def test_engine_config_rejects_bad_scheduling_settings(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**changes)
    with pytest.raises(ValueError, match="scheduling policy must be one of"):
        Scheduler(BlockManager(4, 4), 1, 16, policy="lifo")
    assert EngineConfig().scheduling_policy == "fcfs" and EngineConfig().priority_aging_s == 10.0
    assert EngineConfig(scheduling_policy="priority", priority_aging_s=0).priority_aging_s == 0


def test_fcfs_engine_rejects_a_priority_and_priority_engine_stores_it() -> None:
    fcfs = build_engine(MODEL, EngineConfig(num_kv_blocks=8))
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="priority scheduling is not enabled: start the engine with "
                                         "scheduling_policy='priority'"):
        fcfs.add_request("x", [1, 2], params, priority=1)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.add_request("x", [1, 2], params, priority=-1)
    assert not fcfs.has_unfinished()
    fcfs.add_request("y", [1, 2], params, priority=0, tenant="t")
    assert fcfs.scheduler.waiting[0].tenant == "t"
    with pytest.raises(ValueError, match="priority must be an integer"):
        fcfs.add_request("z", [1, 2], params, priority=1.5)
    prio = build_engine(MODEL, EngineConfig(num_kv_blocks=8, scheduling_policy="priority"))
    prio.add_request("neg", [1, 2], params, arrival_time=123.0, priority=-3, tenant="acme")
    q = prio.scheduler.waiting[0]
    assert (q.priority, q.tenant, q.arrival_time) == (-3, "acme", 123.0)
    assert prio.scheduler.by_priority and prio.scheduler.priority_aging_s == 10.0


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_a_high_priority_arrival_preempts_and_every_output_equals_running_alone(spec) -> None:
    rng = random.Random(7)
    # Repeating prompts give the ngram proposer something to find.
    prompts = {name: [rng.randrange(256) for _ in range(10)] * 4 for name in ("low0", "low1", "high")}
    lengths = {"low0": 40, "low1": 40, "high": 24}
    engine = build_engine(MODEL, EngineConfig(num_kv_blocks=10, block_size=16, scheduling_policy="priority",
                                        speculative_config=spec))
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finished: list[str] = []

    def step() -> None:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            finished.extend([o.request_id] if o.finished else [])

    engine.add_request("low0", prompts["low0"], greedy(lengths["low0"]), priority=5)
    engine.add_request("low1", prompts["low1"], greedy(lengths["low1"]), priority=5)
    while len(tokens["low0"]) < 12:
        step()
    assert engine.stats().num_free_blocks < 3  # the high request's prompt does not fit as is
    engine.add_request("high", prompts["high"], greedy(lengths["high"]), priority=0)
    step()
    running = {q.request_id for q in engine.scheduler.running}
    assert "high" in running and "low1" not in running  # admitted at once, in place of the newest low
    assert len(tokens["high"]) == 1 and engine.stats().num_preemptions_total >= 1
    while engine.has_unfinished():
        step()
    assert finished.index("high") < finished.index("low1")
    alone = LLM(MODEL, engine_config=EngineConfig(kv_cache_memory_bytes=64 << 20))
    for name, prompt in prompts.items():
        assert tokens[name] == alone.generate([prompt], greedy(lengths[name]))[0].token_ids, name
    if spec is not None:
        assert engine.stats().spec_decode_num_draft_tokens > 0


def test_llm_generate_takes_one_priority_per_prompt(monkeypatch) -> None:
    llm = LLM(MODEL, scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=16)
    started: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        started.extend(x.seq.request_id for x in out.scheduled if x.seq.request_id not in started)
        return out

    monkeypatch.setattr(llm.engine.scheduler, "schedule", spy)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    ref = LLM(MODEL, num_kv_blocks=16).generate(prompts, greedy(4))
    outs = llm.generate(prompts, greedy(4), priority=[2, 0, 1])
    assert started == ["llm-1", "llm-2", "llm-0"]  # one at a time, best first
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(prompts, greedy(4), priority=[0, 1])
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        LLM(MODEL, num_kv_blocks=16).generate(prompts, greedy(4), priority=[0, 1, 0])
