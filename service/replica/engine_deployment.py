"""The engine replica, which is also the HTTP edge: one Python process between the socket and
the engine.

`EngineHost` owns one `Engine` on its step thread (`EngineLoop`) and streams each caller's
token deltas to it in the same process: the step thread hands every step's outputs to the
event loop in one wake-up, and each HTTP stream takes, when it next writes, everything that
accumulated for it since (deltas merge when a client reads slower than the engine writes). No
token crosses a Ray process boundary. `EngineDeployment` is the Ray Serve deployment around it:
its FastAPI app (`service.http.api.build_api`) validates, tokenizes, formats and streams.

New requests join the running batch between steps (continuous batching, not `@serve.batch`).
A client that goes away aborts its sequences, so their KV blocks are freed by the next step. A
dead step loop fails every request in flight and makes `check_health` raise, so Serve replaces
the replica; so does a step that makes no progress for longer than `stall_timeout_s` (a wedged
kernel, a deadlock). A tensor-parallel engine's workers (Ray actors in the replica's placement
group) are checked with it: a dead worker fails `check_health` and the step that needs it (its
requests get 503s), Serve replaces the replica and its group, and a stopping replica shuts its
workers down.

A replica that Serve stops (a redeploy, a scale-down) gets no new requests and drains: Serve
waits for its requests in flight, up to the deployment's `graceful_shutdown_timeout_s`, and the
step loop keeps running them to the end meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from ray import serve

from model.config import EngineConfig
from model.engine.sequence import RequestOutput
from model.sampling.params import SamplingParams
from service.engine.engine_loop import EngineFailure, EngineLoop, SubRequest, TorchThread, _Sink
from service.engine.metrics import EngineMetrics
from service.engine.model_info import ModelInfo
from service.http.api import API_KEY_ENV, IngressSettings, build_api, model_cards
from service.http.asgi_forward import ForwardedRequest, ResponseStart, run_asgi
from service.http.engine_call import OverloadPolicy
from service.openai.serving import OpenAIServing
from service.replica.autoscaling import TTFT_WINDOW_S, TTFTWindow, replica_stats
from service.replica.kv_connector import KVTransfer, RayObjectStoreConnector, RemotePrefill
from service.tenancy.quotas import Quotas

logger = logging.getLogger(__name__)

STALL_POLL_S = 1.0  # how often the replica checks whether its engine is stalled
ENGINE_CHECK_TIMEOUT_S = 20.0  # under Serve's health_check_timeout_s: the engine's own check (its workers)
GAUGE_REFRESH_S = 2.0  # well under the ~20 s after which Ray stops exporting an unset gauge


class EngineStream:
    """One HTTP request's deltas from the local engine: `await stream.__anext__()` returns the
    outputs that accumulated since the last call (several steps' worth when the reader lags),
    or an `EngineFailure` as the last item; `cancel()` aborts what is still running."""

    def __init__(self, host: EngineHost, requests: list[SubRequest]) -> None:
        self._host = host
        self._requests = requests
        self._sink: _Sink | None = None
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
        self.loop = EngineLoop(engine, torch_thread)
        self.loop.start()
        self.prefill: Any = None  # a decode replica's RemotePrefill (service/replica/kv_connector.py)
        self.waiting: set[_Sink] = set()  # the sinks of the streams in flight
        self._engine_problem: str | None = None  # what the engine's own check last found (a dead worker)
        self.recent_ttft = TTFTWindow()  # first-token latencies, for the autoscaler (service/replica/autoscaling.py)
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

    def autoscaling_stats(self) -> dict[str, float]:
        """What the TTFT autoscaling policy reads (service/replica/autoscaling.py): requests waiting and
        running in the engine, and the p90 of the recent first-token latencies with their number."""
        stats = self.loop.stats
        return replica_stats(self.recent_ttft, stats.num_waiting, stats.num_running)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the step thread (the timers end with the event loop)."""
        self.loop.stop(timeout_s=timeout_s)


class EngineReplica:
    """One `Engine` per replica behind its own HTTP edge; see the module docstring. Deployed as
    `EngineDeployment` (below)."""

    async def __init__(
        self,
        model: str,
        served_model_name: str,
        engine_config: dict[str, Any],
        settings: dict[str, Any],
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        torch_threads: int | None = None,
        engine_wrapper: Callable[[Any], Any] | None = None,
        revision: str | None = None,
        stall_timeout_s: float = 60.0,
        stream_interval_ms: float = 0.0,
        prefill: Any = None,
        prefill_min_tokens: int = 64,
        prefill_timeout_s: float = 60.0,
        quotas: Any = None,
        ttft_window_s: float = TTFT_WINDOW_S,
    ) -> None:
        """`prefill`: a handle to the `Prefill` deployment (prefill/decode disaggregation): prompts
        of at least `prefill_min_tokens` tokens are prefilled there, each call given up (and the
        prompt prefilled here) after `prefill_timeout_s`.
        `quotas`: a handle to the app's `QuotaLedgerDeployment` (with a keys file)."""
        from model.engine.engine import Engine  # heavy import; keeps this module importable without it

        if torch_threads:
            # The step thread is the only torch user here; Ray's default of OMP_NUM_THREADS=1
            # for fractional CPUs would otherwise leave cores idle (or oversubscribe them).
            torch.set_num_threads(torch_threads)
        config = EngineConfig(**engine_config)
        # Building the model is long synchronous work: keep the replica's event loop responsive. It
        # is built on the thread that then runs its steps (engine_loop.TorchThread says why).
        torch_thread = TorchThread(torch.get_num_threads())
        engine = await asyncio.wrap_future(torch_thread.submit(functools.partial(
            Engine, model=model, engine_config=config, device=device, dtype=dtype, seed=seed, revision=revision)))
        if engine_wrapper is not None:  # tests only (a callable: no config can set it)
            engine = engine_wrapper(engine)
        self._host = EngineHost(engine, served_model_name, stall_timeout_s, stream_interval_s=stream_interval_ms / 1000,
                                torch_thread=torch_thread)
        self._host.recent_ttft = TTFTWindow(ttft_window_s)
        if prefill is not None:
            self._host.prefill = RemotePrefill(prefill, self._host, prefill_min_tokens, prefill_timeout_s)
        self._connector = RayObjectStoreConnector()  # a prefill replica's side of a transfer
        # The key may be set only where the replicas run (a cluster's environment).
        settings = settings | {"api_key": settings.get("api_key") or os.environ.get(API_KEY_ENV) or None}
        self._settings = IngressSettings(**settings)
        overload = OverloadPolicy(self._settings.overload_status, self._settings.retry_after_s,
                                  self._settings.admission_capacity)
        tenants = Quotas(quotas, self._host.metrics) if self._settings.api_keys_file else None
        self._serving = OpenAIServing(self._host.model_info(), self._host, overload, self._settings.request_timeout_s,
                                      self._settings.tool_call_parser, self._settings.reasoning_parser,
                                      tuple(self._settings.app_models), tenants,
                                      config.scheduling_policy == "priority", self._settings.image_limits())
        self._created = int(time.time())  # the model cards' time
        runtime = engine.runtime
        logger.info("engine ready: model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d torch_threads=%d "
                    "admission=%d api key %s", model, runtime.device, runtime.dtype, runtime.max_model_len,
                    runtime.num_kv_blocks, torch.get_num_threads(), overload.capacity,
                    "keys file" if self._settings.api_keys_file else "on" if self._settings.api_key else "off")

    def __serve_build_asgi_app__(self) -> Any:
        return self._edge()

    _edge_app: Any = None

    def _edge(self) -> Any:
        """This replica's HTTP edge, the FastAPI app over its engine: one per replica, so that what
        HAProxy sends and what `forward` carries share its state (the Responses store)."""
        if self._edge_app is None:
            self._edge_app = self._build_edge()
        return self._edge_app

    def _build_edge(self) -> Any:
        return build_api(self._serving, self._host.healthy, self._settings, self._host.metrics.observe_response,
                         created=self._created)

    async def forward(self, route: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request from the multi-model front (service/multi_model.py), answered by this
        replica's HTTP edge as if HAProxy had sent it; `route` is what the request router picks the
        replica by (a `RoutingPrompt`, or None). Call it through a streaming handle."""
        async for item in run_asgi(self._edge(), request):
            yield item

    async def prefill(self, prompt_token_ids: list[int], lora: str | None = None) -> KVTransfer:
        """Prefill/decode disaggregation, the prefill side: compute the prompt (one token, greedy)
        and hand its cached blocks to the connector for a decode replica to fetch. A caller that
        goes away aborts the prompt (Serve cancels this call), freeing its blocks."""
        request = SubRequest(f"prefill-{uuid.uuid4().hex}", list(prompt_token_ids),
                             SamplingParams(max_tokens=1, temperature=0.0), lora)
        stream = self._host.generate([request])
        try:
            async for item in stream:
                if isinstance(item, EngineFailure):
                    raise RuntimeError(f"prefill failed ({item.status}): {item.message}")
        finally:
            stream.cancel()
        engine = self._host.engine
        blocks = await self._host.loop.run_between_steps(functools.partial(engine.export_prefix, request.prompt_token_ids,
                                                                           lora))
        return self._connector.send(blocks)

    def model_info(self, route: Any = None) -> ModelInfo:
        """The served model's facts; `route` (a `ToModel`) is what the request router picks a
        replica of a multi-model deployment by."""
        return self._host.model_info()

    def model_cards(self, route: Any = None) -> list[dict[str, Any]]:
        """This replica's `/v1/models` cards (its model and adapters); `route` as for `model_info`."""
        return model_cards(self._serving, self._created)

    def record_replica_metadata(self) -> dict[str, Any]:
        """Read by Serve once the replica is ready and shown to request routers: the model it serves,
        and where its shared KV tier keeps blocks with the salt of their hashes (the router looks
        there for what any replica can load)."""
        engine = self._host.engine
        share = getattr(engine, "kv_share", None)
        return {"model": self._host.served_model_name,
                **({} if share is None else {"kv_share": {"dir": share.directory, "salt": engine.prefix_salt.hex()}})}

    def healthy(self) -> bool:
        """False once the step loop has died or has made no progress for `stall_timeout_s`;
        the same rule as `check_health`."""
        return self._host.healthy()

    def engine_stats(self) -> dict[str, Any]:
        """The latest `EngineStats` snapshot as a dict (debugging and tests)."""
        return dataclasses.asdict(self._host.loop.stats)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the prefix router weighs replicas by (Serve polls it): requests in the engine, and
        the LoRA adapters resident in it."""
        stats = self._host.loop.stats
        return {"num_requests": stats.num_running + stats.num_waiting, "lora_adapters": list(stats.lora_resident)}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (polled when the deployment autoscales; on the event loop,
        where the TTFT window is written): see `EngineHost.autoscaling_stats`."""
        return self._host.autoscaling_stats()

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes Serve replace the replica (and, with
        tensor parallelism, its placement group and workers)."""
        problem = self._host.problem()
        if problem is None:
            await self._host.check_engine()
            problem = self._host.problem()
        if problem is not None:
            raise RuntimeError(problem)

    def __del__(self) -> None:
        host = getattr(self, "_host", None)
        if host is None:
            return
        host.stop(timeout_s=1.0)
        shutdown = getattr(host.engine, "shutdown", None)  # a tensor-parallel engine's workers
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # the replica is going away whatever happens; its workers die with it
                logger.exception("could not shut the engine's workers down")


DEPLOYMENT_DEFAULTS = {"health_check_period_s": 5, "health_check_timeout_s": 30}
# The app's ingress: the replica's HTTP edge (the FastAPI app built per replica by
# __serve_build_asgi_app__) is what HAProxy sends requests to.
EngineDeployment = serve.deployment(name="EngineDeployment", **DEPLOYMENT_DEFAULTS)(serve.ingress()(EngineReplica))
# One model of a multi-model app (service/multi_model.py): Serve takes one ASGI ingress per app, the
# front, which reaches this replica's edge through `forward`.
EngineBackend = serve.deployment(name="EngineBackend", **DEPLOYMENT_DEFAULTS)(EngineReplica)
# Prefill/decode disaggregation: the replicas that prefill prompts for the engine replicas
# (`EngineDeployment`) that decode them, called through `prefill` only.
PrefillDeployment = serve.deployment(name="Prefill", **DEPLOYMENT_DEFAULTS)(EngineReplica)
