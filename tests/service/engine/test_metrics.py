"""service/engine/metrics.py: what `EngineMetrics.refresh` sets from an engine's stats (Ray's
metric objects, their calls recorded instead of sent)."""

from __future__ import annotations

from dataclasses import replace

from model import LLM, SamplingParams
from model.engine.sequence import LOWEST_PRIORITY
from service.engine.metrics import EngineMetrics


def test_the_queue_gauges_split_by_priority_class_add_up_to_the_totals() -> None:
    llm = LLM("transformer-base", scheduling_policy="priority", max_num_seqs=1, num_kv_blocks=32)
    for i, priority in enumerate((0, LOWEST_PRIORITY, LOWEST_PRIORITY, 2)):
        llm.engine.add_request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True),
                               priority=priority)
    llm.engine.step()  # one slot: r0 (interactive) runs; r3 and the two batch rows wait
    metrics = EngineMetrics("tiny")
    sets: dict[tuple[str, str], list[float]] = {}
    assert metrics.by_priority._name == "qkv_num_requests_by_priority"
    metrics.by_priority.set = lambda v, tags: sets.setdefault((tags["priority_class"], tags["state"]), []).append(v)

    metrics.refresh(llm.engine.stats())
    assert sets == {("interactive", "running"): [1], ("batch", "running"): [0],
                    ("interactive", "waiting"): [1], ("batch", "waiting"): [2]}

    # A batch row running beside a waiting interactive one: each class where it is.
    sets.clear()
    metrics.refresh(replace(llm.engine.stats(), num_running=3, num_running_lowest=2, num_waiting=1,
                            num_waiting_lowest=0))
    assert sets == {("interactive", "running"): [1], ("batch", "running"): [2],
                    ("interactive", "waiting"): [1], ("batch", "waiting"): [0]}
