"""The app's KV index (`KVIndex`, service/routing/kv_index.py) as one Serve deployment: every
engine replica publishes its KV events to it (`kv_cache_index`), and the prefix route asks it, for
each request, which replicas hold the prompt's leading blocks. One replica: the index lives in it.
If it restarts it starts empty and fills again from the replicas' next events and heartbeats
(until then, requests are routed by the router's own record and by load)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from model.engine.kv.events import KVEventBatch
from service.engine.metrics import METRICS
from service.routing.kv_index import KVIndex, Layout

logger = logging.getLogger(__name__)

STATS_REFRESH_S = 2.0  # the index's gauges, set again this often (Ray drops a gauge left unset)


@serve.deployment(name="KVIndex", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class KVIndexDeployment:
    async def __init__(self, model_name: str, ttl_s: float = 10.0) -> None:
        self._index = KVIndex(ttl_s)
        specs = {spec.attr: spec for spec in METRICS}
        self._blocks = specs["kv_index_blocks"].register(model_name)
        self._replicas = specs["kv_index_replicas"].register(model_name)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            try:
                self._index.expire()
                stats = self._index.stats()
                self._blocks.set(stats["blocks"])
                self._replicas.set(stats["replicas"])
            except Exception:  # noqa: BLE001 (a metric is not worth stopping for)
                logger.exception("could not set the KV index's gauges")
            await asyncio.sleep(STATS_REFRESH_S)

    async def publish(self, replica: str, batches: list[KVEventBatch], layout: Layout | None = None) -> None:
        self._index.publish(replica, batches, layout)

    async def lookup(self, prompt_token_ids: list[int], lora: str | None = None,
                     tiers: list[str] | None = None) -> dict[str, int]:
        return self._index.lookup(prompt_token_ids, lora, tiers)

    async def forget(self, replica: str) -> None:
        self._index.forget(replica)

    async def stats(self) -> dict[str, Any]:
        return {**self._index.stats(), "held": self._index.replicas()}

