"""Prefix-aware request routing for the engine replicas (Ray Serve's `RequestRouter` extension).

Each engine caches the K/V of the full prompt blocks it computed (block_manager.py). This router
remembers which replica it last sent each full block of a prompt to, keyed by the same chained
block hashes the engine uses. A request goes to the replica that holds the longest run of its
leading blocks, unless that replica is much busier than the least busy one
(`imbalance_threshold` more requests); then, and for prompts with no known prefix, it is "power
of two choices": two random replicas, the less busy first.

It runs where replicas are picked. With HAProxy (the default), HAProxy asks the prefix-route
deployment (service/routing/prefix_route.py) for each request's replica; that deployment tokenizes the
body and calls `choose_replica` with a `RoutingPrompt`, and this router, which only picks there
(nothing is dispatched through it), records the pick as the prefix's owner itself and weighs
replicas by the requests each reports in its engine (`record_routing_stats`, polled by Serve).
A caller that sends `generate(list[SubRequest])` through a handle gets the same policy with
Serve's own bookkeeping of what it routed.

LoRA adapters: a request for an adapter hashes its blocks salted by the adapter's name (as the
engine's cache does), so a prefix cached under one adapter never attracts another's request. With
no known prefix it goes to a replica holding the adapter: one that reports it resident
(`lora_adapters` in its routing stats) or the one this router last sent it to (recorded at pick
time, so a burst for an adapter no replica has yet loads it on one replica, not on all), the
least busy of those, unless it has `imbalance_threshold` more requests than the least busy replica.

Several models in one deployment (service/app/multi.py): each replica serves one model and says
which in its `record_replica_metadata` (`{"model": served name}`); a call whose routing argument
names a `model` is routed among that model's replicas only, by the same policy. The prefix chain
is salted by the model too, so two models never share an owner map entry.

The shared KV tier (`kv_share_dir`, model/engine/kv/share.py): the replicas of a node publish the
prompt blocks they compute to a shared directory, and say where in `record_replica_metadata`
(`{"kv_share": {"dir", "salt"}}`). The router looks there for the request's leading blocks (one
stat per block, hashed as the engines hash them): what the tier holds, every replica loads instead
of recomputing, so leaving the holder costs only what it holds beyond the tier, and the holder is
kept only within `tier_imbalance_threshold` more requests than the least busy replica. The router
must run on the replicas' node to see the files (elsewhere it sees none and routes as without).

With the cluster's KV index (`kv_cache_index`, service/routing/kv_index.py), the prefix route asks
the index which replicas hold the prompt's leading blocks and passes its answer in the routing
argument (`RoutingPrompt.held`): the router then goes by what the engines say they hold (evictions,
blocks computed for requests it did not route, a replica that died) instead of by what it routed.
Without it, what it knows is what it routed, not what the engines still hold: an engine may have
evicted a block since, and several router replicas each learn on their own. Both only cost hit
rate (and an adapter load), never correctness.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from model.engine.kv.block_manager import block_hashes, sequence_salt
from model.engine.kv.share_layout import leading_files

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingPrompt:
    """The routing argument of a pick-only `choose_replica` call: the request's prompt ids, the
    LoRA adapter it runs under (None: the base model) and the served model whose replicas may take
    it (None: any replica). The router appends why it picked to `picked_by` ("prefix", "adapter"
    or "load"): the caller's record of each decision (service/routing/prefix_route.py)."""

    prompt_token_ids: list[int]
    lora: str | None = None
    model: str | None = None
    picked_by: list[str] = field(default_factory=list, compare=False)
    # What the cluster's KV index says the replicas hold (service/routing/kv_index.py): replica
    # unique id -> leading full blocks of the prompt it holds. None: not asked (no index, or it
    # did not answer in time); the router then goes by what it routed itself.
    held: dict[str, int] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ToModel:
    """The first argument of a dispatched handle call that must reach a replica serving `model`
    (a multi-model deployment's replicas asking each other for their model cards)."""

    model: str


@dataclass(frozen=True)
class _Route:
    """What one request is routed by."""

    prompt: list[int] | None = None
    lora: str | None = None
    pick_only: bool = False  # a `RoutingPrompt`: nothing is dispatched, no on_request_routed follows
    model: str | None = None  # only replicas serving this model may take it; None: any
    picked_by: list[str] | None = None  # a pick-only call's out-list: why the router picked
    held: dict[str, int] | None = None  # the KV index's answer (`RoutingPrompt.held`)
    replica: str | None = None  # a `ToReplica` (service/replica/peer_fetch.py): that replica only


def replica_model(replica: RunningReplica) -> str | None:
    """The served model a replica reported in its `record_replica_metadata` (None: it did not say)."""
    return (getattr(replica, "replica_metadata", None) or {}).get("model")


def _route(pending_request: PendingRequest | None) -> _Route:
    """The prompt ids and adapter a request routes by, and whether the call only picks."""
    if pending_request is None or not pending_request.args:
        return _Route()
    first = pending_request.args[0]
    # By duck type: Serve ships this router to the caller by value (cloudpickle), so its
    # `RoutingPrompt` is not the class object the caller built the argument with.
    if not isinstance(first, list) and hasattr(first, "prompt_token_ids"):
        prompt = first.prompt_token_ids
        picked_by = getattr(first, "picked_by", None)
        held = getattr(first, "held", None)
        return _Route(prompt if isinstance(prompt, list) else None, getattr(first, "lora", None), True,
                      getattr(first, "model", None), picked_by if isinstance(picked_by, list) else None,
                      held if isinstance(held, dict) else None)
    # A `ToReplica` (service/replica/peer_fetch.py): the call must reach that replica; while it is not
    # among the running ones, none is chosen (the call waits, and its caller bounds the wait).
    if not isinstance(first, list) and isinstance(getattr(first, "replica_unique_id", None), str):
        return _Route(replica=first.replica_unique_id)
    if not isinstance(first, list) and isinstance(getattr(first, "model", None), str):  # a `ToModel`
        return _Route(model=first.model)
    if isinstance(first, list) and first:  # generate(list[SubRequest]): the choices share the prompt
        return _Route(getattr(first[0], "prompt_token_ids", None), getattr(first[0], "lora", None))
    return _Route()


def _salt(lora: str | None, model: str | None = None) -> bytes:
    """The hash chain's seed: a prefix under one adapter (or model) is not the same prefix under another."""
    return (b"" if model is None else b"|model:" + model.encode()) + (b"" if lora is None else b"|lora:" + lora.encode())


class PrefixAwareRouter(RequestRouter):
    """Sends requests that share a prefix to the replica that computed it, and requests for a LoRA
    adapter to a replica holding it; balances by load otherwise."""

    def initialize_state(self, block_size: int = 16, imbalance_threshold: int = 8, min_match_rate: float = 0.1,
                         max_blocks: int = 200_000, max_adapters: int = 10_000, route_by_prefix: bool = True,
                         model_block_sizes: dict[str, int] | None = None, tier_imbalance_threshold: int = 1,
                         **_: Any) -> None:
        """`request_router_kwargs`: the engine's `block_size`; how many more requests in flight the
        prefix's (or adapter's) replica may have than the least busy one; the least fraction of the
        prompt that must match; how many block hashes and adapters to remember (least recently
        routed forgotten first); `route_by_prefix` False (engines without a prefix cache): by
        adapter and load only; `model_block_sizes`: a multi-model deployment's block size per served
        model, where it differs from `block_size`; `tier_imbalance_threshold`: the holder's allowance
        when the shared KV tier holds all it holds (leaving it then costs a load, not a prefill)."""
        self._route_by_prefix = route_by_prefix
        self._block_size = block_size
        self._model_block_sizes = dict(model_block_sizes or {})
        self._imbalance = imbalance_threshold
        self._tier_imbalance = tier_imbalance_threshold
        self.tier_blocks_seen = 0  # leading blocks of routed prompts found in the shared tier (tests, debugging)
        self._min_match_rate = min_match_rate
        self._max_blocks = max_blocks
        self._max_adapters = max_adapters
        self._owner: OrderedDict[bytes, ReplicaID] = OrderedDict()  # block hash -> replica, oldest first
        self._adapter_owner: OrderedDict[str, ReplicaID] = OrderedDict()  # adapter -> replica last sent it
        self._in_flight: dict[ReplicaID, set[str]] = {}  # what this router sent and is not done yet

    def _hashes(self, route: _Route) -> list[bytes]:
        """Block hashes of the request's prompt, salted by its adapter."""
        if not route.prompt or not self._route_by_prefix:
            return []
        return block_hashes(route.prompt, self._block_size_of(route), _salt(route.lora, route.model))

    def _block_size_of(self, route: _Route) -> int:
        return self._model_block_sizes.get(route.model, self._block_size) if route.model else self._block_size

    def _tier_run(self, route: _Route, candidates: list[RunningReplica]) -> int:
        """How many of the prompt's leading blocks the candidates' shared KV tier holds (0: none, or
        no tier). Hashed as the engines hash them: their salt, then the adapter's."""
        share = next((meta["kv_share"] for r in candidates
                      if "kv_share" in (meta := getattr(r, "replica_metadata", None) or {})), None)
        if share is None or not route.prompt or not self._route_by_prefix:
            return 0
        size = self._block_size_of(route)
        keys = block_hashes(route.prompt, size, sequence_salt(bytes.fromhex(share["salt"]), route.lora),
                            limit=(len(route.prompt) - 1) // size)  # the engine computes the last token
        run = leading_files(share["dir"], keys)
        self.tier_blocks_seen += run
        return run

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        reported = (getattr(replica, "routing_stats", None) or {}).get("num_requests", 0)
        return max(cached or 0, reported, len(self._in_flight.get(replica.replica_id, ())))

    def _remember(self, route: _Route, hashes: list[bytes], replica_id: ReplicaID) -> None:
        for h in hashes:
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_blocks:
            self._owner.popitem(last=False)
        if route.lora is not None:
            self._adapter_owner[route.lora] = replica_id
            self._adapter_owner.move_to_end(route.lora)
            while len(self._adapter_owner) > self._max_adapters:
                self._adapter_owner.popitem(last=False)

    def _adapter_holders(self, lora: str, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """The candidates that report `lora` resident, or that this router last sent it to."""
        owner = self._adapter_owner.get(lora)
        return [r for r in candidates if r.replica_id == owner
                or lora in ((getattr(r, "routing_stats", None) or {}).get("lora_adapters") or ())]

    def _holder(self, hashes: list[bytes], candidates: dict[ReplicaID, RunningReplica]) -> tuple[RunningReplica | None, int]:
        """The candidate that was sent the longest run of `hashes`, and its length in blocks."""
        holder, run = None, 0
        for h in hashes:
            owner = self._owner.get(h)
            if owner is None or owner not in candidates or (holder is not None and owner != holder.replica_id):
                break
            holder, run = candidates[owner], run + 1
        return holder, run

    def _indexed_holder(self, held: dict[str, int], candidates: list[RunningReplica]
                        ) -> tuple[RunningReplica | None, int]:
        """The candidate the KV index says holds the longest run of the prompt's leading blocks
        (the least busy of those tied), and its length in blocks."""
        best = max((held.get(r.replica_id.unique_id, 0) for r in candidates), default=0)
        if best == 0:
            return None, 0
        return min((r for r in candidates if held.get(r.replica_id.unique_id, 0) == best), key=self._load), best

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = _route(pending_request)
        if route.replica is not None:
            target = [r for r in candidate_replicas if r.replica_id.unique_id == route.replica]
            return [target] if target else []
        if route.model is not None:  # a multi-model deployment: that model's replicas only
            candidate_replicas = [r for r in candidate_replicas if replica_model(r) == route.model]
        if not candidate_replicas:
            return []
        hashes = self._hashes(route)
        least = min(self._load(r) for r in candidate_replicas)
        ranks: list[list[RunningReplica]] | None = None
        why = "load"
        if hashes:
            holder, run = (self._indexed_holder(route.held, candidate_replicas) if route.held is not None
                           else self._holder(hashes, {r.replica_id: r for r in candidate_replicas}))
            # Leaving the holder recomputes what it holds beyond the shared tier, or only loads it.
            usable = min(run, (len(route.prompt or ()) - 1) // self._block_size_of(route))  # the last token is computed
            allowance = self._imbalance if holder is None or usable > self._tier_run(route, candidate_replicas) \
                else self._tier_imbalance
            if holder is not None and run * self._block_size_of(route) >= self._min_match_rate * len(route.prompt or ()) \
                    and self._load(holder) - least <= allowance:
                # The holder first; if it cannot take the request, the others by load.
                ranks, why = [[holder], [r for r in candidate_replicas if r is not holder]], "prefix"
        if ranks is None and route.lora is not None:
            holders = sorted(self._adapter_holders(route.lora, candidate_replicas), key=self._load)
            if holders and self._load(holders[0]) - least <= self._imbalance:
                ranks = [holders, sorted((r for r in candidate_replicas if r not in holders), key=self._load)]
                why = "adapter"
        if ranks is None:
            two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            ranks = [sorted(two, key=self._load)]  # stable: equal loads keep the random order
        if route.pick_only:
            # The pick is the route and no on_request_routed follows: rank one replica first, the
            # one remembered (Serve would pick the shortest queue within a rank of several).
            chosen = ranks[0][0]
            ranks = [[chosen], [r for rank in ranks for r in rank if r is not chosen]]
            self._remember(route, hashes, chosen.replica_id)
            if route.picked_by is not None:
                route.picked_by.append(why)
        return [rank for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight.setdefault(replica_id, set()).add(pending_request.metadata.internal_request_id)
        route = _route(pending_request)
        self._remember(route, self._hashes(route), replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._in_flight.get(replica_id, set()).discard(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
