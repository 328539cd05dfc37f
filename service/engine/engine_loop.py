"""The engine's step loop on its own thread, bridged to asyncio.

`Engine` is not thread-safe, so one thread owns it: it applies queued adds and aborts between
steps, runs `step()` while there is work, and hands each step's outputs to the callers' asyncio queues
in one `loop.call_soon_threadsafe` per step (one wake-up of the event loop, however many
requests the step served). The replica's event loop therefore stays free to accept, stream
and cancel while torch runs (torch releases the GIL in its kernels). The thread is named
`STEP_THREAD_NAME` at the OS level, and so are the torch worker threads it starts, so a
profiler can tell the step's CPU from the serving path's. No Ray here, so it can be tested alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from model.engine.sequence import RequestOutput
from model.loading.lora import LoraNotFoundError
from model.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAKEUP_S = 1.0  # an idle loop still refreshes its stats (and reports progress) this often
STEP_THREAD_NAME = "qkv-step"  # the OS name of the step thread (/proc/<pid>/task/<tid>/comm)


def _name_os_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux; elsewhere a no-op). Threads it creates
    afterwards, such as torch's OpenMP workers, inherit it."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


@dataclass
class SubRequest:
    """One engine request: one (prompt, choice) pair of an HTTP request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None  # the LoRA adapter the request runs under (None: the base model)
    priority: int = 0  # lower runs sooner (vLLM's meaning), with scheduling_policy "priority"
    tenant: str | None = None  # whose request (a keys file's tenant): the scheduler shares slots among tenants
    mm: Any = None  # the prompt's images (model.multimodal.inputs.MultiModalInputs, from Engine.process_images)


@dataclass
class EngineFailure:
    """Sent instead of outputs when a request cannot go on: bad input (400) or a dead loop."""

    status: int
    message: str


class Sink:
    """Where one caller's outputs land: a list fed on the caller's event loop (from the loop
    thread through `call_soon_threadsafe`), and a future the reader waits on while it is empty.
    Lighter than an asyncio.Queue, which this is on the path of every token."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[list[RequestOutput] | EngineFailure] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_threadsafe(self, item: list[RequestOutput] | EngineFailure) -> None:
        try:
            self._loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    @staticmethod
    def put_many_threadsafe(items: list[tuple[Sink, list[RequestOutput]]]) -> None:
        """Deliver one step's outputs to many sinks with one wake-up per event loop."""
        by_loop: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[Sink, list[RequestOutput]]]]] = {}
        for sink, outs in items:
            by_loop.setdefault(id(sink._loop), (sink._loop, []))[1].append((sink, outs))
        for loop, batch in by_loop.values():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def put(self, item: list[RequestOutput] | EngineFailure) -> None:
        """Add an item from the sink's own event loop."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get_all(self, not_before: float = 0.0) -> list[list[RequestOutput] | EngineFailure]:
        """Wait for one item, then take everything already there, so a slow consumer gets
        several steps at once instead of falling behind. A caller that paces its reads passes
        `not_before` (event-loop time): nothing is taken before then, so everything the steps
        delivered meanwhile comes out in one list."""
        delay = not_before - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


def _deliver(batch: list[tuple[Sink, list[RequestOutput]]]) -> None:
    for sink, outs in batch:
        sink.put(outs)


def _call(fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
    """On the step thread: run a `run_between_steps` call; its failure is the caller's, not the loop's."""
    try:
        result, error = fn(), None
    except Exception as exc:
        result, error = None, exc
    _settle_threadsafe(loop, future, result, error)


def _settle_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
                       error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the event loop is closed: nobody is waiting any more
        pass


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by its caller meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class TorchThread:
    """One daemon thread for all of a replica's torch work: building its engine, then the step
    loop (and, through `EngineLoop.run_between_steps`, whatever must not run beside a step).

    Why one thread: in the service, with the engine built on another thread (asyncio.to_thread)
    and stepped on a new one, the step's threads got 1.07-1.17 cores at 16 and 32 clients
    (`loadtests/benchmarks/bench_service.py`, five runs) where the bare engine gets 1.85; built and stepped
    here, 1.60-1.75 (two runs), and the service made about 1.1-1.2x the tokens (medians across
    runs). Why it helps is not established: OpenMP's thread count is per thread (MKL alone in a new
    thread ran on OMP_NUM_THREADS, which Ray sets to the replica's CPUs), but the first ATen
    parallel op of a thread applies torch's count there, so the engine's steps were not on one
    core for that reason; and with more OpenMP threads than cores (the builder's idle team
    counts) libgomp shortens its spin-waits, but `loadtests/benchmarks/bench_step_thread.py`, the same
    layouts without Ray, showed no difference (1.10x, spread 0.82-1.15, with a busy neighbour).
    This thread sets torch's count itself before any work."""

    def __init__(self, num_threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(num_threads,), name="engine-step-loop", daemon=True)
        self._thread.start()

    def _serve(self, num_threads: int) -> None:
        _name_os_thread(STEP_THREAD_NAME)
        torch.set_num_threads(num_threads)
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's future carries it
                future.set_exception(exc)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn()` on this thread after what was submitted before it."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def is_alive(self) -> bool:
        return self._thread.is_alive()


class EngineLoop:
    """Owns an `Engine` and runs its steps on a dedicated daemon thread (`torch_thread`, the one
    that built the engine; a new one when None)."""

    def __init__(self, engine: Any, torch_thread: TorchThread | None = None) -> None:
        self._engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any, Sink | None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._sinks: dict[str, Sink] = {}  # touched only by the loop thread
        self._stopping = False
        self.error: str | None = None
        self.stats = engine.stats()  # a snapshot, replaced (never mutated) by the loop thread
        self._last_progress = time.monotonic()  # end of the loop's last step or idle check
        self._torch = torch_thread if torch_thread is not None else TorchThread(torch.get_num_threads())
        self._running: concurrent.futures.Future[Any] | None = None  # the step loop, once started

    @property
    def alive(self) -> bool:
        return (self.error is None and self._running is not None and not self._running.done()
                and self._torch.is_alive())

    def stalled_s(self) -> float:
        """Seconds since the loop last made progress (finished a step, or found nothing to do).
        An idle loop checks in every IDLE_WAKEUP_S, so only a step that does not return (a
        wedged kernel, a deadlock) lets this grow past a few seconds."""
        return time.monotonic() - self._last_progress

    def problem(self, stall_timeout_s: float) -> str | None:
        """Why this loop cannot serve (dead, or no progress for longer than `stall_timeout_s`
        while it has work), or None when it is fine."""
        if not self.alive:
            return f"engine step loop is dead: {self.error or 'stopped'}"
        stalled = self.stalled_s()
        if stalled > stall_timeout_s:
            return f"engine step has made no progress for {stalled:.0f}s (limit {stall_timeout_s:g}s)"
        return None

    def start(self) -> None:
        self._running = self._torch.submit(self._run)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._running is not None:
            concurrent.futures.wait([self._running], timeout_s)

    def submit(self, requests: list[SubRequest]) -> Sink:
        """Queue `requests` for the next step; their outputs (lists of deltas) or an
        `EngineFailure` arrive on the returned sink. Call from the event loop that reads it."""
        sink = Sink(asyncio.get_running_loop())
        if not self.alive:
            sink.put_threadsafe(EngineFailure(
                503, "The engine is not running; the replica will be replaced, retry the request."))
            return sink
        for request in requests:
            self._commands.put(("add", request, sink))
        self._wakeup.set()
        if not self.alive:  # died while we queued: the loop may never drain these commands
            sink.put_threadsafe(EngineFailure(503, f"The engine is not running: {self.error or 'stopped'}"))
        return sink

    def run_between_steps(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn()` on the step thread before its next step: torch work that must not run
        beside a step (embeddings, `service/openai/embeddings.py`). The returned future (of the
        calling event loop) gets fn's result or exception, or an `EngineFailure` (503) when the
        loop is not running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.alive:
            self._commands.put(("call", (fn, loop, future), None))
            self._wakeup.set()
        if not self.alive:  # dead before, or died while we queued: the loop may never run it
            _settle(future, EngineFailure(503, f"The engine is not running: {self.error or 'stopped'}"), None)
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed by
        the next step."""
        for request_id in request_ids:
            self._commands.put(("abort", request_id, None))
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self._engine.has_unfinished():
                    self.stats = self._engine.stats()
                    self._last_progress = time.monotonic()
                    self._wakeup.wait(IDLE_WAKEUP_S)
                    self._wakeup.clear()
                    self._last_progress = time.monotonic()
                    continue
                outputs = self._engine.step()
                self._last_progress = time.monotonic()
                self.stats = self._engine.stats()
                self._dispatch(outputs)
        except Exception as exc:  # the step itself failed: nothing in flight can go on
            logger.exception("engine step loop died")
            self._fail_all(exc)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, payload, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._engine.abort_request(payload)
                continue
            if kind == "call":
                _call(*payload)
                continue
            try:
                extra: dict[str, Any] = {"lora": payload.lora} if payload.lora is not None else {}
                if payload.priority:
                    extra["priority"] = payload.priority
                if payload.tenant is not None:
                    extra["tenant"] = payload.tenant
                if payload.mm is not None:
                    extra["mm"] = payload.mm
                self._engine.add_request(payload.request_id, payload.prompt_token_ids, payload.params, **extra)
            except ValueError as exc:  # the HTTP edge checks first; this is the last line
                sink.put_threadsafe(EngineFailure(404 if isinstance(exc, LoraNotFoundError) else 400, str(exc)))
                continue
            self._sinks[payload.request_id] = sink

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_sink: dict[int, tuple[Sink, list[RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            by_sink.setdefault(id(sink), (sink, []))[1].append(out)
            if out.finished:
                del self._sinks[out.request_id]
        Sink.put_many_threadsafe(list(by_sink.values()))

    def _fail_all(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"  # logged and in check_health; never sent to clients
        # 503: the replica is replaced, so the same request can succeed when retried. The
        # exception's text may name server paths, so clients get only its type.
        failure = EngineFailure(503, f"The engine failed while generating ({type(exc).__name__}); "
                                     "the replica will be replaced, retry the request.")
        sinks = {id(s): s for s in self._sinks.values()}
        while True:  # requests queued but never added fail too
            try:
                kind, payload, sink = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "call":
                _settle_threadsafe(payload[1], payload[2], failure, None)
            if sink is not None:
                sinks[id(sink)] = sink
        self._sinks.clear()
        for sink in sinks.values():
            sink.put_threadsafe(failure)
