"""The app's KV index (`KVIndex`, service/routing/kv_index.py) as one Serve deployment: every
engine replica publishes its KV events to it (`kv_cache_index`), and the prefix route asks it, for
each request, which replicas hold the prompt's leading blocks. One replica: the index lives in it.
If it restarts it starts empty and fills again from the replicas' next events and heartbeats
(until then, requests are routed by the router's own record and by load)."""

from __future__ import annotations

from typing import Any

from ray import serve

from model.engine.kv.events import KVEventBatch
from service.routing.kv_index import KVIndex, Layout


@serve.deployment(name="KVIndex", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class KVIndexDeployment:
    def __init__(self, ttl_s: float = 10.0) -> None:
        self._index = KVIndex(ttl_s)

    async def publish(self, replica: str, batches: list[KVEventBatch], layout: Layout | None = None) -> None:
        self._index.publish(replica, batches, layout)

    async def lookup(self, prompt_token_ids: list[int], lora: str | None = None) -> dict[str, int]:
        return self._index.lookup(prompt_token_ids, lora)

    async def forget(self, replica: str) -> None:
        self._index.forget(replica)

    async def stats(self) -> dict[str, Any]:
        return {**self._index.stats(), "held": self._index.replicas()}
