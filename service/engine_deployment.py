"""The engine replica: hosts one `Engine`, streams token deltas, records the metrics.

New requests join the running batch between steps (continuous batching, not `@serve.batch`).
A caller that goes away (client disconnect -> the handle call is cancelled) aborts its
sequences, so their KV blocks are freed by the next step. A dead step loop fails every request
in flight and makes `check_health` raise, so Serve replaces the replica; so does a step that
makes no progress for longer than `stall_timeout_s` (a wedged kernel, a deadlock).

A replica that Serve stops (a redeploy, a scale-down) gets no new calls and drains: Serve waits
for its calls in flight, up to the deployment's `graceful_shutdown_timeout_s`, and the step loop
keeps running them to the end meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch
from ray import serve

from model.config import EngineConfig
from model.engine.sequence import RequestOutput
from model.loading.generation_config import GenerationConfig
from service.engine_loop import EngineFailure, EngineLoop, SubRequest
from service.metrics import EngineMetrics

logger = logging.getLogger(__name__)

STALL_POLL_S = 1.0  # how often the replica checks whether its engine is stalled
GAUGE_REFRESH_S = 2.0  # well under the ~20 s after which Ray stops exporting an unset gauge


@dataclass
class ModelInfo:
    """What the HTTP edge needs to validate and tokenize without loading the model."""

    served_model_name: str
    max_model_len: int
    vocab_size: int  # the embedding's size: valid token ids are below it
    num_kv_blocks: int
    block_size: int
    tokenizer: Any  # model.loading.tokenizer.Tokenizer (and the special tokens); picklable, so the ingress tokenizes itself
    generation_config: GenerationConfig  # sampling defaults for fields a request does not set
    attention: Any = None  # model.inspect.attention_spec.AttentionShape: checks /v1/attention requests


@serve.deployment(name="EngineDeployment", health_check_period_s=5, health_check_timeout_s=30)
class EngineDeployment:
    """One `Engine` per replica; see the module docstring."""

    async def __init__(
        self,
        model: str,
        served_model_name: str,
        engine_config: dict[str, Any],
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        torch_threads: int | None = None,
        engine_wrapper: Callable[[Any], Any] | None = None,
        revision: str | None = None,
        stall_timeout_s: float = 60.0,
        stream_interval_ms: float = 0.0,
    ) -> None:
        from model.engine.engine import Engine  # heavy import; keeps this module importable without it

        if torch_threads:
            # The step thread is the only torch user here; Ray's default of OMP_NUM_THREADS=1
            # for fractional CPUs would otherwise leave cores idle (or oversubscribe them).
            torch.set_num_threads(torch_threads)
        config = EngineConfig(**engine_config)
        # Building the model is long synchronous work: keep the replica's event loop responsive.
        self._engine = await asyncio.to_thread(
            Engine, model=model, engine_config=config, device=device, dtype=dtype, seed=seed, revision=revision
        )
        if engine_wrapper is not None:  # tests only (a callable: no config can set it)
            self._engine = engine_wrapper(self._engine)
        self._served_model_name = served_model_name
        self._stall_timeout_s = stall_timeout_s
        self._stream_interval_s = stream_interval_ms / 1000.0
        self._metrics = EngineMetrics(served_model_name)
        self._loop = EngineLoop(self._engine)
        self._loop.start()
        self._waiting: set[Any] = set()  # the sinks of the generate() calls in flight
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())
        self._watchdog = asyncio.get_running_loop().create_task(self._fail_callers_while_stalled())
        runtime = self._engine.runtime
        logger.info("engine ready: model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d torch_threads=%d",
                    model, runtime.device, runtime.dtype, runtime.max_model_len, runtime.num_kv_blocks,
                    torch.get_num_threads())

    def model_info(self) -> ModelInfo:
        runtime = self._engine.runtime
        return ModelInfo(
            served_model_name=self._served_model_name,
            max_model_len=runtime.max_model_len,
            vocab_size=self._engine.model_config.vocab_size,
            num_kv_blocks=runtime.num_kv_blocks,
            block_size=runtime.block_size,
            tokenizer=self._engine.tokenizer,
            generation_config=self._engine.generation_config,
            attention=self._engine.attention_shape,
        )

    async def generate(self, requests: list[SubRequest]) -> AsyncIterator[list[RequestOutput] | EngineFailure]:
        """Stream the deltas of `requests` (the choices of one HTTP request) as they come out
        of the steps; several steps are merged when the caller reads slower than they come,
        and, with `stream_interval_ms`, into one message per interval at most (the first goes
        out at once), which cuts the messages per token on the way to the client.
        An `EngineFailure` is the last item when the requests cannot go on."""
        if any(r.params.structured is not None for r in requests):
            try:  # compiled (or found cached) here, off the step thread, so the batch never waits for it
                await asyncio.to_thread(self._engine.structured.prepare, [r.params for r in requests])
            except ValueError as exc:
                yield EngineFailure(400, str(exc))
                return
        sink = self._loop.submit(requests)
        self._waiting.add(sink)
        pending = {r.request_id for r in requests}
        last_token_time: dict[str, float | None] = dict.fromkeys(pending)
        clock = asyncio.get_running_loop()
        not_before = 0.0  # event-loop time of the next message
        try:
            while pending:
                batch: list[RequestOutput] = []
                for item in await sink.get_all(not_before):
                    if isinstance(item, EngineFailure):
                        if batch:
                            yield batch
                        yield item
                        return
                    batch.extend(item)
                for out in batch:
                    last_token_time[out.request_id] = self._metrics.observe(out, last_token_time[out.request_id])
                    if out.finished:
                        pending.discard(out.request_id)
                yield batch
                not_before = clock.time() + self._stream_interval_s
        finally:
            # Reached on normal completion, on cancellation (client gone) and on aclose().
            self._waiting.discard(sink)
            if pending:
                logger.info("aborting %d request(s): the caller went away", len(pending))
                self._loop.abort(sorted(pending))
                for r in requests:
                    if r.request_id in pending:
                        self._metrics.observe_abort(len(r.prompt_token_ids))

    async def _fail_callers_while_stalled(self) -> None:
        """While the engine is stalled, its wedged step delivers nothing: end every call in
        flight with a 503 instead, so callers can retry elsewhere and the replica can drain and
        be replaced (on the event loop: the sinks' queues belong to it)."""
        while True:
            await asyncio.sleep(STALL_POLL_S)
            problem = self._loop.problem(self._stall_timeout_s)
            if problem is None or not self._waiting:
                continue
            logger.error("failing %d call(s) in flight: %s", len(self._waiting), problem)
            for sink in list(self._waiting):
                sink.put(EngineFailure(503, "The engine stopped making progress; the replica will be replaced, "
                                            "retry the request."))

    def healthy(self) -> bool:
        """False once the step loop has died or has made no progress for `stall_timeout_s`;
        the same rule as `check_health`."""
        return self._loop.problem(self._stall_timeout_s) is None

    def engine_stats(self) -> dict[str, Any]:
        """The latest `EngineStats` snapshot as a dict (debugging and tests)."""
        return dataclasses.asdict(self._loop.stats)

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica."""
        problem = self._loop.problem(self._stall_timeout_s)
        if problem is not None:
            raise RuntimeError(problem)

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                self._metrics.refresh(self._loop.stats)
            except Exception:  # a metrics hiccup must not stop the refresher
                logger.exception("could not refresh the engine gauges")
            await asyncio.sleep(GAUGE_REFRESH_S)

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop(timeout_s=1.0)
