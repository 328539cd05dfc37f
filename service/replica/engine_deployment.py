"""The engine replica, which is also the HTTP edge: one Python process between the socket and
the engine.

`EngineHost` owns one `Engine` on its step thread (`EngineLoop`) and streams each caller's
token deltas to it in the same process: the step thread hands every step's outputs to the
event loop in one wake-up, and each HTTP stream takes, when it next writes, everything that
accumulated for it since (deltas merge when a client reads slower than the engine writes). No
token crosses a Ray process boundary. `EngineDeployment` is the Ray Serve deployment around it:
its FastAPI app (`service.server.api.build_api`) validates, tokenizes, formats and streams.

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
from model.sampling.params import SamplingParams
from service.autoscaling import TTFT_WINDOW_S, TTFTWindow
from service.engine.engine_loop import EngineFailure, SubRequest, TorchThread
from service.engine.model_info import ModelInfo
from service.host.engine_host import EngineHost
from service.http.asgi_forward import ForwardedRequest, ResponseStart, run_asgi
from service.replica.kv_connector import KVTransfer, RayObjectStoreConnector, RemotePrefill, checksummed
from service.replica.peer_fetch import PeerFetch
from service.server.api import API_KEY_ENV, IngressSettings, build_api, edge_serving, model_cards
from service.tenancy.quotas import Quotas

logger = logging.getLogger(__name__)


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
        kv_index: Any = None,
        kv_remote_fetch: bool = False,
        kv_remote_fetch_min_tokens: int = 256,
        kv_remote_fetch_timeout_s: float = 5.0,
    ) -> None:
        """`prefill`: a handle to the `Prefill` deployment (prefill/decode disaggregation): prompts
        of at least `prefill_min_tokens` tokens are prefilled there, each call given up (and the
        prompt prefilled here) after `prefill_timeout_s`.
        `quotas`: a handle to the app's `QuotaLedgerDeployment` (with a keys file).
        `kv_index`: a handle to the app's `KVIndex` deployment (`kv_cache_index`): this replica's KV
        events go there, under its replica id, with how its engine hashes prompts. `kv_remote_fetch`
        (with `kv_index`): prompts of at least `kv_remote_fetch_min_tokens` tokens take the blocks
        another replica's pool holds instead of computing them, where that is faster, each fetch
        given up (and the prompt computed here) after `kv_remote_fetch_timeout_s`."""
        from model.engine.builder import build_engine  # heavy import; keeps this module importable without it

        if torch_threads:
            # The step thread is the only torch user here; Ray's default of OMP_NUM_THREADS=1
            # for fractional CPUs would otherwise leave cores idle (or oversubscribe them).
            torch.set_num_threads(torch_threads)
        config = EngineConfig(**engine_config)
        # Building the model is long synchronous work: keep the replica's event loop responsive. It
        # is built on the thread that then runs its steps (engine_loop.TorchThread says why).
        torch_thread = TorchThread(torch.get_num_threads())
        engine = await asyncio.wrap_future(torch_thread.submit(functools.partial(
            build_engine, model=model, engine_config=config, device=device, dtype=dtype, seed=seed, revision=revision)))
        if engine_wrapper is not None:  # tests only (a callable: no config can set it)
            engine = engine_wrapper(engine)
        self._host = EngineHost(engine, served_model_name, stall_timeout_s, stream_interval_s=stream_interval_ms / 1000,
                                torch_thread=torch_thread)
        self._host.recent_ttft = TTFTWindow(ttft_window_s)
        if prefill is not None:
            self._host.prefill = RemotePrefill(prefill, self._host, prefill_min_tokens, prefill_timeout_s)
        if kv_index is not None:
            replica_id = serve.get_replica_context().replica_id.unique_id
            layout = (engine.runtime.block_size, engine.prefix_salt.hex())
            self._host.publish_kv_events(lambda batches: kv_index.publish.remote(replica_id, batches, layout))
            if kv_remote_fetch:
                context = serve.get_replica_context()
                self._host.peer_fetch = PeerFetch(
                    self._host, kv_index, lambda: serve.get_deployment_handle(context.deployment, context.app_name),
                    replica_id, kv_remote_fetch_min_tokens, kv_remote_fetch_timeout_s)
        self._connector = RayObjectStoreConnector()  # a prefill replica's side of a transfer
        # The key may be set only where the replicas run (a cluster's environment).
        settings = settings | {"api_key": settings.get("api_key") or os.environ.get(API_KEY_ENV) or None}
        self._settings = IngressSettings(**settings)
        tenants = Quotas(quotas, self._host.metrics) if self._settings.api_keys_file else None
        self._serving = edge_serving(self._host, self._settings, tenants, config.scheduling_policy == "priority")
        self._batch_offline = None
        if self._settings.batch_dir and self._settings.batch_offline_min_lines:
            from service.offline.batch_job import EdgeSpec, OfflineBatches  # Ray Data: only where it is used

            spec = EdgeSpec(model, served_model_name, engine_config, dataclasses.asdict(self._settings),
                            "cuda" if self._settings.batch_offline_num_gpus > 0 else "cpu", dtype, seed, revision)
            self._batch_offline = OfflineBatches(spec, self._settings.batch_offline_min_lines,
                                                 self._settings.batch_offline_concurrency,
                                                 self._settings.batch_offline_num_cpus,
                                                 self._settings.batch_offline_num_gpus)
        self._created = int(time.time())  # the model cards' time
        runtime = engine.runtime
        logger.info("engine ready: model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d torch_threads=%d "
                    "admission=%d api key %s", model, runtime.device, runtime.dtype, runtime.max_model_len,
                    runtime.num_kv_blocks, torch.get_num_threads(), self._settings.admission_capacity,
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
                         created=self._created, batch_metrics=self._host.metrics, batch_offline=self._batch_offline)

    async def forward(self, route: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """One HTTP request from the multi-model front (service/app/multi.py), answered by this
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
        return self._connector.send(await checksummed(blocks))

    async def export_cached(self, route: Any, prompt_token_ids: list[int], lora: str | None = None) -> KVTransfer:
        """Cross-node prefix fetch, the holder's side: the blocks this replica's pool holds of the
        prompt's leading full blocks (none, if it evicted them since it told the KV index), with each
        block's checksum, handed to the connector. `route` (a `ToReplica`) is what the request
        router sends the call to this replica by. Nothing is computed."""
        blocks = await self._host.loop.run_between_steps(functools.partial(
            self._host.engine.export_prefix, list(prompt_token_ids), lora))
        if isinstance(blocks, EngineFailure):
            raise RuntimeError(f"the engine is not running ({blocks.status}): {blocks.message}")
        return self._connector.send(await checksummed(blocks))

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
# One model of a multi-model app (service/app/multi.py): Serve takes one ASGI ingress per app, the
# front, which reaches this replica's edge through `forward`.
EngineBackend = serve.deployment(name="EngineBackend", **DEPLOYMENT_DEFAULTS)(EngineReplica)
# Prefill/decode disaggregation: the replicas that prefill prompts for the engine replicas
# (`EngineDeployment`) that decode them, called through `prefill` only.
PrefillDeployment = serve.deployment(name="Prefill", **DEPLOYMENT_DEFAULTS)(EngineReplica)
