"""The engine step loop on its thread, without Ray: outputs reach asyncio, aborts free blocks,
a failing step fails every request in flight and marks the loop dead (and /health says so)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.sampling.params import SamplingParams
from service.engine.admission import AdmissionGate, admission_capacity
from service.engine.engine_loop import IDLE_WAKEUP_S, EngineFailure, EngineLoop, SubRequest
from service.server.api import IngressSettings, build_api
from tests.support.local_serve import write_tiny_checkpoint
from tests.support.polling import wait_until_async


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=2048)
    return build_engine(str(ckpt), EngineConfig(max_num_seqs=4, num_kv_blocks=256))


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
            reads = [[out for item in await asyncio.wait_for(sink.get_all(), 60) for out in item]]
            # The reader lags until the engine is done with the request: however fast or slow the
            # steps ran, those after the first read are all waiting in the sink.
            await wait_until_async(lambda: not engine.has_unfinished(), 60, "the request to finish")
            while not reads[-1][-1].finished:
                not_before = clock.time() + 0.2
                items = await asyncio.wait_for(sink.get_all(not_before), 60)
                assert clock.time() >= not_before  # nothing was taken before then
                reads.append([out for item in items for out in item])
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
            # the loop's idle stats snapshot follows the step that freed the blocks
            await wait_until_async(lambda: loop.stats.num_running == 0 and loop.stats.kv_cache_usage == 0.0, 60,
                                   "the loop's stats to show the blocks freed")
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


def _health_probe(value: Any) -> Any:
    def healthy() -> bool:
        if isinstance(value, Exception):
            raise value
        return value
    return healthy


@pytest.mark.parametrize(("healthy", "status"), [(True, 200), (False, 503), (RuntimeError("gone"), 503)])
def test_health_reports_a_dead_engine(healthy: Any, status: int) -> None:
    app = build_api(serving=None, healthy=_health_probe(healthy), settings=IngressSettings(api_key="k"))
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
            assert await asyncio.to_thread(engine.wedged.wait, 60)
            assert loop.problem(stall_timeout_s=600.0) is None  # just started: well within a bound
            # ...and a problem once the step has been stuck past the bound (it only grows)
            problem = await wait_until_async(lambda: loop.problem(stall_timeout_s=2.0), 60, "the stall to be a problem")
            assert loop.alive and "no progress" in problem
            engine.wedge.clear()
            engine.release.set()  # the step returns: progress again
            await wait_until_async(lambda: loop.problem(stall_timeout_s=2.0) is None, 60, "the loop to progress again")
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


class _CountingMetrics:
    """Stands in for `EngineMetrics` (Ray's metrics need a Ray worker): counts what is recorded."""

    def __init__(self) -> None:
        self.tokens = 0
        self.aborted = 0

    def observe(self, out: Any, last_token_time: float | None) -> float | None:
        self.tokens += len(out.new_token_ids)
        return out.token_times[-1] if out.token_times else last_token_time

    def observe_abort(self, num_prompt_tokens: int) -> None:
        self.aborted += 1

    def refresh(self, stats: Any) -> None:
        pass


def test_a_lagging_stream_gets_every_step_since_its_last_read_in_one_batch(engine: Engine) -> None:
    """The replica's stream (service/replica/engine_deployment.py): a reader that comes back late takes
    every delta delivered meanwhile at once, in order, nothing lost; the step thread woke the
    event loop once per step for all streams, not once per request."""
    from service.host.engine_host import EngineHost

    async def run() -> None:
        metrics = _CountingMetrics()
        host = EngineHost(engine, "tiny", metrics=metrics)
        wakeups = 0
        event_loop = asyncio.get_running_loop()
        original = event_loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return original(*args, **kwargs)

        event_loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            streams = [host.generate([SubRequest(f"r{i}", [1 + i, 2, 3], params)]) for i in range(3)]
            first = [await asyncio.wait_for(s.__anext__(), 60) for s in streams]  # queued now
            assert all(isinstance(b, list) for b in first)
            # The reader lags until the engine is done: the steps go on without it.
            await wait_until_async(lambda: not engine.has_unfinished(), 60, "the requests to finish")
            batches = {i: first[i] + await asyncio.wait_for(s.__anext__(), 60) for i, s in enumerate(streams)}
            assert any(len(b) > 2 for b in batches.values()), "nothing merged while the reader lagged"
            for i, s in enumerate(streams):
                while not batches[i][-1].finished:
                    batches[i] += await asyncio.wait_for(s.__anext__(), 60)
                with pytest.raises(StopAsyncIteration):
                    await s.__anext__()
                assert sum(len(d.new_token_ids) for d in batches[i]) == 24
            assert metrics.tokens == 3 * 24
            # One wake-up per step carries all three streams' deltas (plus the adds' own).
            assert wakeups <= 24 + 6, wakeups
        finally:
            event_loop.call_soon_threadsafe = original  # type: ignore[method-assign]
            host.stop()

    asyncio.run(run())


def test_cancelling_a_stream_aborts_its_requests_and_frees_their_blocks(engine: Engine) -> None:
    from service.host.engine_host import EngineHost

    async def run() -> None:
        metrics = _CountingMetrics()
        host = EngineHost(engine, "tiny", metrics=metrics)
        try:
            free = engine.stats().num_free_blocks
            params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
            stream = host.generate([SubRequest("long-a", [1] * 40, params), SubRequest("long-b", [2] * 40, params)])
            await asyncio.wait_for(stream.__anext__(), 60)
            stream.cancel()
            assert metrics.aborted == 2
            await wait_until_async(lambda: not engine.has_unfinished(), 60, "the aborted requests to leave the engine")
            assert engine.stats().num_free_blocks == free
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
        finally:
            host.stop()

    asyncio.run(run())


STEP_THREAD_OMP = """
import asyncio, ctypes, sys
import torch
from model.config import EngineConfig
from model.engine.builder import build_engine
from service.engine.engine_loop import EngineLoop

torch.set_num_threads(2)  # as the replica does, on its own thread, before the loop starts
gomp = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
omp_get_max_threads = ctypes.CDLL(gomp).omp_get_max_threads


async def main() -> None:
    loop = EngineLoop(build_engine(sys.argv[1], EngineConfig(max_num_seqs=1, num_kv_blocks=8)))
    loop.start()
    try:
        print(await asyncio.wait_for(loop.run_between_steps(omp_get_max_threads), 60))
    finally:
        loop.stop()

asyncio.run(main())
"""


def test_the_step_thread_runs_torch_on_the_threads_set_for_the_replica(tmp_path) -> None:
    """Ray sets OMP_NUM_THREADS to a replica's CPUs (1 by default) and the replica asks torch for
    more threads; OpenMP's (and so MKL's) count is per thread: the step thread applies it before
    any work (else MKL called before the thread's first ATen parallel op runs on one thread)."""
    import os
    import subprocess
    import sys

    import torch

    if not torch.backends.openmp.is_available():
        pytest.skip("torch without OpenMP")
    ckpt = write_tiny_checkpoint(tmp_path / "tiny")
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", STEP_THREAD_OMP, str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "2", done.stdout
