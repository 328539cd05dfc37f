"""`EngineHost` owns one `Engine` on its step thread (`EngineLoop`) and streams each caller's
token deltas to it in the same process: the step thread hands every step's outputs to the event
loop in one wake-up, and each stream (`EngineStream`) takes, when it next writes, everything that
accumulated for it since (deltas merge when a client reads slower than the engine writes). No
token crosses a process boundary, and nothing here needs Ray: the Serve deployment
(service/replica/engine_deployment.py) and the in-process tests host an engine the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from model.engine.kv.events import AllBlocksCleared, KVEventBatch
from model.engine.sequence import RequestOutput
from service.autoscaling import TTFTWindow, replica_stats
from service.engine.engine_loop import EngineFailure, EngineLoop, Sink, SubRequest, TorchThread
from service.engine.metrics import EngineMetrics
from service.engine.model_info import ModelInfo

logger = logging.getLogger(__name__)

STALL_POLL_S = 1.0  # how often the replica checks whether its engine is stalled
ENGINE_CHECK_TIMEOUT_S = 20.0  # under Serve's health_check_timeout_s: the engine's own check (its workers)
GAUGE_REFRESH_S = 2.0  # well under the ~20 s after which Ray stops exporting an unset gauge
KV_PUBLISH_S = 0.25  # how often the engine's KV events (or a heartbeat) go to the cluster's KV index
KV_UNSENT_MAX = 400  # event batches kept for a resend while the index does not answer (100 s at KV_PUBLISH_S)


class EngineStream:
    """One HTTP request's deltas from the local engine: `await stream.__anext__()` returns the
    outputs that accumulated since the last call (several steps' worth when the reader lags),
    or an `EngineFailure` as the last item; `cancel()` aborts what is still running."""

    def __init__(self, host: EngineHost, requests: list[SubRequest]) -> None:
        self._host = host
        self._requests = requests
        self._sink: Sink | None = None
        self._pending = {r.request_id for r in requests}
        self._lora_of = {r.request_id: r.lora for r in requests}
        self._last_token_time: dict[str, float | None] = dict.fromkeys(self._pending)
        self._failure: EngineFailure | None = None  # delivered after the outputs that came before it
        self._finished = False
        self._not_before = 0.0  # event-loop time of the next read (stream_interval_s)

    async def _submit(self) -> EngineFailure | None:
        host = self._host
        if any(r.params.structured is not None for r in self._requests):
            try:  # compiled (or found cached) here, off the step thread, so the batch never waits for it
                await asyncio.to_thread(host.engine.structured.prepare, [r.params for r in self._requests])
            except ValueError as exc:
                return EngineFailure(400, str(exc))
        if host.prefill is not None:  # prefill/decode disaggregation: the prompt's blocks from the prefill deployment
            await host.prefill.fetch(self._requests)
        if host.peer_fetch is not None:  # blocks of the prompt another replica's pool holds (kv_remote_fetch)
            await host.peer_fetch.fetch(self._requests)
        self._sink = host.loop.submit(self._requests)
        host.waiting.add(self._sink)
        return None

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> list[RequestOutput] | EngineFailure:
        if self._sink is None and not self._finished:
            failure = await self._submit()
            if failure is not None:
                self._finished = True
                return failure
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self._close()
            return failure
        if self._finished or not self._pending:
            self._close()
            raise StopAsyncIteration
        assert self._sink is not None
        batch: list[RequestOutput] = []
        for item in await self._sink.get_all(self._not_before):
            if isinstance(item, EngineFailure):
                if not batch:
                    self._close()
                    return item
                self._failure = item
                break
            batch.extend(item)
        metrics = self._host.metrics
        for out in batch:
            if self._last_token_time[out.request_id] is None and out.times.first_token is not None:  # its first token
                self._host.recent_ttft.add(out.times.first_token - out.times.arrival)
            self._last_token_time[out.request_id] = metrics.observe(out, self._last_token_time[out.request_id])
            if out.finished:
                self._pending.discard(out.request_id)
                if self._lora_of.get(out.request_id) is not None:
                    metrics.observe_lora_request(self._lora_of[out.request_id])
        if self._host.stream_interval_s:
            self._not_before = asyncio.get_running_loop().time() + self._host.stream_interval_s
        return batch

    def _close(self) -> None:
        self._finished = True
        if self._sink is not None:
            self._host.waiting.discard(self._sink)

    def cancel(self) -> None:
        """Abort the requests still running (the client went away, or the request is over
        whatever happened); their blocks are freed by the next step. Idempotent."""
        self._close()
        if self._sink is None or not self._pending:
            self._pending.clear()
            return
        pending, self._pending = sorted(self._pending), set()
        logger.info("aborting %d request(s): the caller went away", len(pending))
        self._host.loop.abort(pending)
        for r in self._requests:
            if r.request_id in pending:
                self._host.metrics.observe_abort(len(r.prompt_token_ids))


def _lora_info(lora: Any) -> dict[str, Any]:
    """ModelInfo's LoRA fields from the engine's `LoraManager` (None: no adapters)."""
    if lora is None:
        return {}
    return {"lora_adapters": tuple(lora.names()), "lora_dynamic": lora.dynamic_path is not None}


class EngineHost:
    """An `Engine` on its step thread, its metrics and its watchdog; no Ray deployment logic,
    so the HTTP edge can be tested over it directly. Create it on the event loop that will
    read its streams."""

    def __init__(self, engine: Any, served_model_name: str, stall_timeout_s: float = 60.0,
                 metrics: Any = None, stream_interval_s: float = 0.0, torch_thread: TorchThread | None = None) -> None:
        self.engine = engine
        self.stream_interval_s = stream_interval_s  # each stream reads at most this often (0: as it comes)
        self.served_model_name = served_model_name
        self.stall_timeout_s = stall_timeout_s
        if getattr(engine, "lora", None) is not None:  # `<served name>:<adapter>` names a dynamic adapter
            engine.lora.base_names.add(served_model_name)
        self.metrics = metrics if metrics is not None else EngineMetrics(served_model_name)
        runtime = getattr(engine, "runtime", None)
        if runtime is not None and hasattr(self.metrics, "set_startup"):
            self.metrics.set_startup(runtime)
        self.loop = EngineLoop(engine, torch_thread)
        self.loop.start()
        self.prefill: Any = None  # a decode replica's RemotePrefill (service/replica/kv_connector.py)
        self.peer_fetch: Any = None  # its PeerFetch (service/replica/peer_fetch.py)
        self.waiting: set[Sink] = set()  # the sinks of the streams in flight
        self._engine_problem: str | None = None  # what the engine's own check last found (a dead worker)
        self.recent_ttft = TTFTWindow()  # first-token latencies, for the autoscaler (service/autoscaling.py)
        event_loop = asyncio.get_running_loop()
        self._tasks = [event_loop.create_task(self._refresh_gauges()),
                       event_loop.create_task(self._fail_callers_while_stalled())]

    def generate(self, requests: list[SubRequest]) -> EngineStream:
        """The stream of `requests` (the choices of one HTTP request); nothing is queued
        before its first `__anext__`."""
        return EngineStream(self, requests)

    async def process_images(self, prompt_token_ids: list[int], images: list[Any]) -> tuple[list[int], Any]:
        """`Engine.process_images` (the prompt with each image placeholder expanded, and its
        `MultiModalInputs`) on a worker thread: CPU work kept off the event loop and the step thread."""
        return await asyncio.to_thread(self.engine.process_images, prompt_token_ids, images)

    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters known now: the start-up ones and those loaded by name since."""
        lora = getattr(self.engine, "lora", None)
        return tuple(lora.names()) if lora is not None else ()

    def model_info(self) -> ModelInfo:
        runtime = self.engine.runtime
        scheme = getattr(self.engine, "quant_scheme", None)  # the weights' quantization; None: full precision
        return ModelInfo(
            served_model_name=self.served_model_name,
            max_model_len=runtime.max_model_len,
            vocab_size=self.engine.model_config.vocab_size,
            num_kv_blocks=runtime.num_kv_blocks,
            block_size=runtime.block_size,
            tokenizer=self.engine.tokenizer,
            generation_config=self.engine.generation_config,
            attention=self.engine.attention_shape,
            quantization={**scheme.describe(),
                          "activations": "int8" if getattr(self.engine, "int8_activations", False) else "float32",
                          "lm_head": head.describe() if (head := getattr(self.engine, "head_scheme", None)) else None}
            if scheme else None,
            **_lora_info(getattr(self.engine, "lora", None)),
            takes_images=getattr(self.engine, "image_processor", None) is not None,
        )

    def problem(self) -> str | None:
        """Why this engine cannot serve (dead loop, stalled, or its own check failed), or None."""
        return self.loop.problem(self.stall_timeout_s) or self._engine_problem

    async def check_engine(self, timeout_s: float = ENGINE_CHECK_TIMEOUT_S) -> None:
        """Run the engine's own `check_health` (it pings a tensor-parallel engine's workers) on a
        thread of its own: `Engine.check_health` may run beside a step, so a long or wedged step
        does not delay it. A failure is kept for `problem()`; a check that does not answer within
        `timeout_s` gives no verdict (a wedged step is the stall rule's to catch)."""
        check = getattr(self.engine, "check_health", None)
        if check is None or self._engine_problem is not None or not self.loop.alive:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(check), timeout_s)
        except asyncio.TimeoutError:
            logger.warning("the engine's health check did not answer within %.0fs", timeout_s)
            return
        except Exception as exc:  # a dead worker (model.engine.parallel's WorkerDiedError), or worse
            self._engine_problem = f"engine check failed: {type(exc).__name__}: {exc}"
            logger.error("%s", self._engine_problem)

    def healthy(self) -> bool:
        return self.problem() is None

    async def _fail_callers_while_stalled(self) -> None:
        """While the engine is stalled, its wedged step delivers nothing: end every stream in
        flight with a 503 instead, so callers can retry elsewhere and the replica can drain and
        be replaced (on the event loop: the sinks' queues belong to it)."""
        while True:
            await asyncio.sleep(STALL_POLL_S)
            problem = self.problem()
            if problem is None or not self.waiting:
                continue
            logger.error("failing %d call(s) in flight: %s", len(self.waiting), problem)
            what = "A worker of the engine failed" if self._engine_problem else "The engine stopped making progress"
            for sink in list(self.waiting):
                sink.put(EngineFailure(503, f"{what}; the replica will be replaced, retry the request."))

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                self.metrics.refresh(self.loop.stats)
            except Exception:  # a metrics hiccup must not stop the refresher
                logger.exception("could not refresh the engine gauges")
            await asyncio.sleep(GAUGE_REFRESH_S)

    def publish_kv_events(self, send: Callable[[list[Any]], Awaitable[Any]],
                          interval_s: float = KV_PUBLISH_S) -> asyncio.Task[None]:
        """Every `interval_s`, the engine's KV events since the last time (`Engine.drain_kv_events`,
        taken between steps) go to `send` as a list of batches, in order; an empty list is the
        heartbeat that keeps this replica in the index. Batches a failed send did not deliver go
        again with the next (replaying stores and removals in order leaves the index as it would
        be); past KV_UNSENT_MAX of them they are replaced by one AllBlocksCleared, so the index
        forgets this replica's blocks rather than keep a stale picture (a miss costs a prefill,
        a wrong holder only a detour). Returns the publisher's task: it ends once the engine has
        stopped."""
        task = asyncio.get_running_loop().create_task(self._publish_kv_events(send, interval_s))
        self._tasks.append(task)
        return task

    async def _publish_kv_events(self, send: Callable[[list[Any]], Awaitable[Any]], interval_s: float) -> None:
        unsent: list[KVEventBatch] = []
        failures = 0
        while True:
            try:
                batch = await self.loop.run_between_steps(self.engine.drain_kv_events)
                if isinstance(batch, EngineFailure):  # the engine stopped: so do the heartbeats, and the
                    return  # index forgets this replica within its ttl
                if batch is not None:
                    unsent.append(batch)
                if len(unsent) > KV_UNSENT_MAX:
                    unsent = [KVEventBatch(time.time(), (AllBlocksCleared(),))]
                await send(unsent)
                if hasattr(self.metrics, "observe_kv_events"):
                    self.metrics.observe_kv_events(sum(len(b.events) for b in unsent))
                unsent, failures = [], 0
            except Exception as exc:  # noqa: BLE001 (the index is a routing hint: serving goes on)
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("could not publish KV events to the index (%d in a row): %s: %s", failures,
                                   type(exc).__name__, exc)
            await asyncio.sleep(interval_s)

    def autoscaling_stats(self) -> dict[str, float]:
        """What the TTFT autoscaling policy reads (service/autoscaling.py): requests waiting and
        running in the engine, and the p90 of the recent first-token latencies with their number."""
        stats = self.loop.stats
        return replica_stats(self.recent_ttft, stats.num_waiting, stats.num_running)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the step thread (the timers end with the event loop)."""
        self.loop.stop(timeout_s=timeout_s)
