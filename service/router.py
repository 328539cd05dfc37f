"""Prefix-aware request routing for the engine replicas (Ray Serve's `RequestRouter` extension).

Each engine caches the K/V of the full prompt blocks it computed (block_manager.py). This router,
which runs inside each caller of the engine deployment (the ingress replicas), remembers which
replica it last sent each full block of a prompt to, keyed by the same chained block hashes the
engine uses. A request goes to the replica that holds the longest run of its leading blocks,
unless that replica is much busier than the least busy one (`imbalance_threshold` more requests
in flight); then, and for prompts with no known prefix, it is "power of two choices": two
random replicas, the one with the shorter queue wins.

What it knows is what it routed, not what the engines still hold: an engine may have evicted a
block since, and several ingress replicas each learn on their own. Both only cost hit rate,
never correctness.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from model.engine.block_manager import block_hashes

logger = logging.getLogger(__name__)


class PrefixAwareRouter(RequestRouter):
    """Sends requests that share a prefix to the replica that computed it; balances by load otherwise."""

    def initialize_state(self, block_size: int = 16, imbalance_threshold: int = 8, min_match_rate: float = 0.1,
                         max_blocks: int = 200_000, **_: Any) -> None:
        """`request_router_kwargs`: the engine's `block_size`; how many more requests in flight the
        prefix's replica may have than the least busy one; the least fraction of the prompt that
        must match; how many block hashes to remember (least recently routed forgotten first)."""
        self._block_size = block_size
        self._imbalance = imbalance_threshold
        self._min_match_rate = min_match_rate
        self._max_blocks = max_blocks
        self._owner: OrderedDict[bytes, ReplicaID] = OrderedDict()  # block hash -> replica, oldest first
        self._in_flight: dict[ReplicaID, set[str]] = {}  # what this router sent and is not done yet

    def _hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """Block hashes of the request's prompt (`EngineDeployment.generate(requests)`: the first
        sub-request's prompt; the choices of one HTTP request share it)."""
        if pending_request is None or not pending_request.args:
            return []
        requests = pending_request.args[0]
        prompt = getattr(requests[0], "prompt_token_ids", None) if isinstance(requests, list) and requests else None
        if not prompt:
            return []
        return block_hashes(prompt, self._block_size)

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return max(cached or 0, len(self._in_flight.get(replica.replica_id, ())))

    def _holder(self, hashes: list[bytes], candidates: dict[ReplicaID, RunningReplica]) -> tuple[RunningReplica | None, int]:
        """The candidate that was sent the longest run of `hashes`, and its length in blocks."""
        holder, run = None, 0
        for h in hashes:
            owner = self._owner.get(h)
            if owner is None or owner not in candidates or (holder is not None and owner != holder.replica_id):
                break
            holder, run = candidates[owner], run + 1
        return holder, run

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._hashes(pending_request)
        if hashes:
            holder, run = self._holder(hashes, {r.replica_id: r for r in candidate_replicas})
            prompt_len = len(pending_request.args[0][0].prompt_token_ids)
            if holder is not None and run * self._block_size >= self._min_match_rate * prompt_len:
                least = min(self._load(r) for r in candidate_replicas)
                if self._load(holder) - least <= self._imbalance:
                    # The holder first; if it cannot take the request, the others by load.
                    return [[holder], [r for r in candidate_replicas if r is not holder]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight.setdefault(replica_id, set()).add(pending_request.metadata.internal_request_id)
        for h in self._hashes(pending_request):
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_blocks:
            self._owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
