"""The engine step loop on its thread, without Ray: outputs reach asyncio, aborts free blocks,
a failing step fails every request in flight and marks the loop dead (and /health says so)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model.config import EngineConfig
from model.engine.engine import Engine
from model.sampling.params import SamplingParams
from service.admission import AdmissionGate, admission_capacity
from service.api import IngressSettings, build_api
from service.engine_loop import IDLE_WAKEUP_S, EngineFailure, EngineLoop, SubRequest
from local_serve import write_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=2048)
    return Engine(str(ckpt), EngineConfig(max_num_seqs=4, num_kv_blocks=256))


async def _collect(sink: Any, ids: set[str]) -> tuple[dict[str, list[Any]], EngineFailure | None]:
    outs: dict[str, list[Any]] = {i: [] for i in ids}
    while any(not o or not o[-1].finished for o in outs.values()):
        for item in await asyncio.wait_for(sink.get_all(), 60):
            if isinstance(item, EngineFailure):
                return outs, item
            for out in item:
                outs[out.request_id].append(out)
    return outs, None


def test_outputs_reach_asyncio_in_order(engine: Engine) -> None:
    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        try:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            sink = loop.submit([SubRequest("a", [1, 2, 3], params), SubRequest("b", [4, 5], params)])
            outs, failure = await _collect(sink, {"a", "b"})
            assert failure is None
            for deltas in outs.values():
                assert sum(len(d.new_token_ids) for d in deltas) == 12
                assert deltas[-1].finish_reason == "length"
        finally:
            loop.stop()

    asyncio.run(run())


def test_a_paced_reader_gets_the_steps_delivered_meanwhile_in_one_read(engine: Engine) -> None:
    """What `stream_interval_ms` relies on: reading no earlier than `not_before` returns every
    step's deltas that arrived meanwhile, in order, none lost."""
    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        try:
            clock = asyncio.get_running_loop()
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            sink = loop.submit([SubRequest("p", [1, 2, 3], params)])
            reads: list[list[Any]] = []
            not_before = 0.0
            while not reads or not reads[-1][-1].finished:
                items = await asyncio.wait_for(sink.get_all(not_before), 60)
                assert clock.time() >= not_before
                reads.append([out for item in items for out in item])
                not_before = clock.time() + 0.2
            deltas = [out for read in reads for out in read]
            assert sum(len(d.new_token_ids) for d in deltas) == 24
            assert [d.num_output_tokens for d in deltas] == sorted(d.num_output_tokens for d in deltas)
            assert len(reads) < len(deltas) and max(len(r) for r in reads) > 1, [len(r) for r in reads]
        finally:
            loop.stop()

    asyncio.run(run())


def test_abort_frees_blocks_within_a_step(engine: Engine) -> None:
    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        try:
            long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
            sink = loop.submit([SubRequest("long", [1, 2, 3], long)])
            first = await asyncio.wait_for(sink.get_all(), 60)
            assert first[0][0].request_id == "long" and not first[0][-1].finished
            loop.abort(["long"])
            outs, _ = await _collect(sink, {"long"})
            assert outs["long"][-1].finish_reason == "abort"
            assert sum(len(d.new_token_ids) for d in outs["long"]) < 2000
            await asyncio.sleep(0.1)  # let the loop take its idle stats snapshot
            assert loop.stats.num_running == 0 and loop.stats.kv_cache_usage == 0.0
        finally:
            loop.stop()

    asyncio.run(run())


def test_bad_input_reaching_the_engine_is_a_400(engine: Engine) -> None:
    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start()
        try:
            sink = loop.submit([SubRequest("x", [], SamplingParams(max_tokens=2))])
            (failure,) = await asyncio.wait_for(sink.get_all(), 10)
            assert failure.status == 400 and "prompt" in failure.message
            assert loop.alive
        finally:
            loop.stop()

    asyncio.run(run())


class _FailingEngine:
    """Steps fine twice, then raises, like a CUDA error mid-generation."""

    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.steps = 0

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.requests.add(request_id)

    def abort_request(self, request_id: str) -> None:
        self.requests.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[Any]:
        self.steps += 1
        if self.steps > 2:
            raise RuntimeError("device lost")
        return []

    def stats(self) -> Any:
        return None


def test_a_failing_step_fails_every_request_and_kills_the_loop() -> None:
    async def run() -> None:
        loop = EngineLoop(_FailingEngine())
        loop.start()
        params = SamplingParams(max_tokens=5)
        sinks = [loop.submit([SubRequest(f"r{i}", [1], params)]) for i in range(3)]
        for sink in sinks:
            (failure,) = await asyncio.wait_for(sink.get_all(), 10)
            assert failure.status == 503 and "retry" in failure.message
            assert "device lost" not in failure.message  # the exception's text stays in the logs
        assert not loop.alive and "device lost" in loop.error
        (late,) = await asyncio.wait_for(loop.submit([SubRequest("late", [1], params)]).get_all(), 10)
        assert late.status == 503

    asyncio.run(run())


class _Remote:
    def __init__(self, value: Any) -> None:
        self._value = value

    async def _get(self) -> Any:
        if isinstance(self._value, Exception):
            raise self._value
        return self._value

    def remote(self) -> Any:
        return self._get()


class _EngineHandle:
    def __init__(self, healthy: Any) -> None:
        self.healthy = _Remote(healthy)


@pytest.mark.parametrize(("healthy", "status"), [(True, 200), (False, 503), (RuntimeError("gone"), 503)])
def test_health_reports_a_dead_engine(healthy: Any, status: int) -> None:
    app = build_api(serving=None, engine=_EngineHandle(healthy), settings=IngressSettings(api_key="k"))
    r = TestClient(app).get("/health")  # open without the key
    assert r.status_code == status
    if status == 503:
        assert r.json()["error"]["type"] == "server_error"


class _WedgingEngine(_FailingEngine):
    """Steps fine until `wedge` is set, then a step blocks until `release` is set (a hung
    kernel); the loop thread stays alive."""

    def __init__(self) -> None:
        super().__init__()
        self.wedge, self.release, self.wedged = threading.Event(), threading.Event(), threading.Event()

    def step(self) -> list[Any]:
        if self.wedge.is_set():
            self.wedged.set()
            self.release.wait(30)
        return []


def test_a_wedged_step_is_a_problem_once_it_passes_the_bound_and_an_idle_loop_never_is() -> None:
    async def run() -> None:
        engine = _WedgingEngine()
        loop = EngineLoop(engine)
        loop.start()
        try:
            await asyncio.sleep(2.5 * IDLE_WAKEUP_S)  # idle well past the bound below: still fine
            assert loop.problem(stall_timeout_s=2.0) is None
            engine.wedge.set()
            loop.submit([SubRequest("r", [1], SamplingParams(max_tokens=5))])
            assert await asyncio.to_thread(engine.wedged.wait, 10)
            assert loop.problem(stall_timeout_s=2.0) is None  # just started: within the bound
            await asyncio.sleep(2.5)
            problem = loop.problem(stall_timeout_s=2.0)
            assert loop.alive and problem is not None and "no progress" in problem
            engine.wedge.clear()
            engine.release.set()  # the step returns: progress again
            await asyncio.sleep(0.5)
            assert loop.problem(stall_timeout_s=2.0) is None
        finally:
            engine.release.set()
            loop.stop()

    asyncio.run(run())


def test_the_admission_gate_admits_exactly_its_capacity() -> None:
    gate = AdmissionGate(admission_capacity(max_ongoing_requests=2, engine_replicas=1, max_queued_requests=2),
                         lambda: RuntimeError("overloaded"))
    for _ in range(4):
        gate.acquire()
    with pytest.raises(RuntimeError, match="overloaded"):
        gate.acquire()
    gate.release()
    gate.acquire()  # a finished request frees its slot
    assert gate.admitted == 4
    unbounded = AdmissionGate(admission_capacity(2, 3, -1), lambda: RuntimeError("never"))
    for _ in range(100):
        unbounded.acquire()
    assert admission_capacity(8, 3, 16) == 40
