"""Large batches of the Batch API as a Ray Data job beside the service (`batch_offline_min_lines`).

A batch of at least `min_lines` requests is not run through the replica's engine: the replica that
holds the batch starts a Ray Data job whose engine actors (`concurrency` of them, each with
`num_cpus` / `num_gpus`) answer its requests, and records each answer in the batch's journal as it
comes back (service/batch/runner.py: cancel, expiry and resume work as for any batch; a batch
whose job failed goes on in that replica's engine). Each actor
runs the replica's own HTTP edge (the same routes, request checks and answer bodies) over an
engine built from the replica's arguments, so a line gets the body the interactive endpoint would
give it; what it does not share with the service is the replica's engine, its queue and its
metrics.

A tenant with quotas (requests or tokens per minute, concurrency) is never handed off: its batch
runs in the replicas, where its quotas count each request. Nor is a batch when the cluster cannot
hold one actor at all (it would wait forever): it runs in the replicas, with a warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray
import torch

from model.config import EngineConfig
from service.batch.api import in_process_send
from service.batch.runner import Answer
from service.engine.engine_loop import TorchThread
from service.host.engine_host import EngineHost
from service.server.api import IngressSettings, build_api, edge_serving
from service.tenancy.keys import Tenant

logger = logging.getLogger(__name__)

TICK_S = 0.5  # how often the runner hears from a job that has no answer yet (it looks for a cancel then)
ROWS_PER_SEQ = 4  # rows handed to an actor at once, per sequence its engine runs at a time
MAX_ROWS_PER_CALL = 1024
_DONE = object()


@dataclass(frozen=True)
class EdgeSpec:
    """What an actor builds: the replica's engine arguments (`EngineDeployment.__init__`'s) and its
    HTTP edge's settings (`IngressSettings` fields)."""

    model: str
    served_model_name: str
    engine_config: dict[str, Any]
    settings: dict[str, Any]
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    revision: str | None = None


@dataclass(frozen=True)
class OfflineBatches:
    """The runner's `Offline` (service/batch/runner.py): large batches as Ray Data jobs on the
    cluster this process belongs to. `tenants(name)`: the keys file's tenant (None: no such tenant);
    bound by the batch service (`with_tenants`)."""

    spec: EdgeSpec
    min_lines: int
    concurrency: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    tenants: Callable[[str], Tenant | None] | None = None

    def with_tenants(self, tenants: Callable[[str], Tenant | None]) -> OfflineBatches:
        return dataclasses.replace(self, tenants=tenants)

    def takes(self, owner: str | None) -> bool:
        if owner is not None:
            tenant = self.tenants(owner) if self.tenants is not None else None
            if tenant is None or not tenant.limits.unlimited:
                return False  # gone (the replicas answer 401 per line), or its quotas count in the replicas
        total = ray.cluster_resources()
        if total.get("CPU", 0.0) < self.num_cpus or total.get("GPU", 0.0) < self.num_gpus:
            logger.warning("a large batch runs in the replicas: the cluster (%s) cannot hold one batch actor "
                           "(num_cpus %s, num_gpus %s)", total, self.num_cpus, self.num_gpus)
            return False
        return True

    async def answers(self, endpoint: str, requests: list[tuple[str, dict[str, Any]]],
                      owner: str | None) -> AsyncGenerator[Answer | None, None]:
        """Run `requests` as one Ray Data job; yields each answer as the job gives it back, and
        None every `TICK_S` without one. Closing the generator stops the job (its actors too)."""
        tenant = self.tenants(owner) if owner is not None and self.tenants is not None else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()
        rows = [{"custom_id": custom_id, "body": json.dumps(body)} for custom_id, body in requests]
        max_seqs = EngineConfig(**self.spec.engine_config).max_num_seqs
        batch_size = max(1, min(MAX_ROWS_PER_CALL, ROWS_PER_SEQ * max_seqs))

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody reads any more
                stop.set()

        def run() -> None:
            try:
                ray.data.DataContext.get_current().enable_progress_bars = False
                ds = ray.data.from_items(rows).map_batches(
                    EdgeBatch, batch_format="pyarrow", batch_size=batch_size,
                    compute=ray.data.ActorPoolStrategy(min_size=1, max_size=self.concurrency),
                    num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                    fn_constructor_kwargs={"spec": self.spec, "endpoint": endpoint, "tenant": tenant})
                it = iter(ds.iter_rows())
                try:
                    for row in it:
                        put((row["custom_id"], int(row["status"]), json.loads(row["body"])))
                        if stop.is_set():
                            break
                finally:
                    close = getattr(it, "close", None)
                    if close is not None:
                        close()  # shuts the job's executor and actors down
                put(_DONE)
            except BaseException as exc:  # noqa: BLE001 (handed to the runner, which ends the run)
                put(exc)

        thread = threading.Thread(target=run, name="batch-offline-job", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), TICK_S)
                except asyncio.TimeoutError:
                    yield None
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the batch's Ray Data job failed: {item}") from item
                yield item
        finally:
            stop.set()  # the job stops at its next answer; what it has in flight is sent again on resume


class EdgeBatch:
    """One engine actor of a job: the replica's HTTP edge over its own engine, on an event loop of
    its own; each call answers a block of rows, all sent at once so that the engine batches them."""

    def __init__(self, spec: EdgeSpec, endpoint: str, tenant: Tenant | None) -> None:
        self.endpoint, self.owner = endpoint, tenant.name if tenant is not None else None
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="batch-edge-loop", daemon=True).start()
        self.send = asyncio.run_coroutine_threadsafe(self._build(spec, tenant), self.loop).result()
        logger.info("batch actor ready: model=%s endpoint=%s", spec.model, endpoint)

    async def _build(self, spec: EdgeSpec, tenant: Tenant | None) -> Any:
        from model.engine.builder import build_engine  # heavy import: only in the actors

        config = EngineConfig(**spec.engine_config)
        torch_thread = TorchThread(torch.get_num_threads())  # as the replica: built and stepped on one thread
        engine = await asyncio.wrap_future(torch_thread.submit(functools.partial(
            build_engine, model=spec.model, engine_config=config, device=spec.device, dtype=spec.dtype,
            seed=spec.seed, revision=spec.revision)))
        host = EngineHost(engine, spec.served_model_name, metrics=NullMetrics(), torch_thread=torch_thread)
        # No batch service inside the actor, no admission bound (the job's rows queue in its engine),
        # and no key check: the rows come from the batch's owner, whose tenant is set per request
        # (the keys file need not be on this node).
        settings = IngressSettings(**(spec.settings | {"batch_dir": None, "admission_capacity": -1, "api_key": None,
                                                       "api_keys_file": None}))
        serving = edge_serving(host, settings, priority_scheduling=config.scheduling_policy == "priority")
        app = build_api(serving, host.healthy, settings)
        return in_process_send(app, lambda _: tenant, None)

    def __call__(self, batch: pa.Table) -> dict[str, list[Any]]:
        rows = batch.to_pylist()

        async def answer_all() -> list[tuple[int, dict[str, Any]]]:
            return await asyncio.gather(*(self.send(self.endpoint, json.loads(r["body"]), self.owner) for r in rows))

        answers = asyncio.run_coroutine_threadsafe(answer_all(), self.loop).result()
        return {"custom_id": [r["custom_id"] for r in rows], "status": [status for status, _ in answers],
                "body": [json.dumps(body) for _, body in answers]}


class NullMetrics:
    """The engine metrics an actor does not report: the service's metrics are its replicas'."""

    def observe(self, out: Any, last: float | None) -> float | None:
        return out.token_times[-1] if out.token_times else last

    def observe_abort(self, num_prompt_tokens: int) -> None:
        pass

    def observe_lora_request(self, lora: str) -> None:
        pass

    def observe_embeddings(self, num_prompt_tokens: int) -> None:
        pass

    def refresh(self, stats: Any) -> None:
        pass
