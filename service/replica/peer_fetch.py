"""Cross-node prefix fetch (`kv_remote_fetch`, with `kv_cache_index`): a replica whose own tiers
miss a prompt's leading blocks that another replica holds (in its pool or its offload tier) takes
those blocks from it instead of computing them, when that is faster
(docs/features/prefix-caching.md).

Before a request with at least `min_tokens` prompt tokens is queued, the replica compares what
its pool and tiers hold of the prompt (`Engine.cached_prefix_blocks`) with what the app's KV index
says each replica holds in any tier it reports (`KVIndex.lookup`). Where a peer holds more, the extra
blocks are fetched if moving their bytes at the link rate measured so far takes less time than
computing their tokens at this engine's measured prefill rate (with neither measured yet, the
first fetch measures the link). The peer is called through the engine deployment's handle,
addressed by its replica id (`ToReplica`, which the prefix router honours); it exports what its
pool and tiers still hold of the prompt between two steps (`Engine.export_prefix`), with each block's
CRC32, into the same connector as prefill/decode transfers (service/replica/kv_connector.py:
Ray's object store, which moves the bytes between nodes). The blocks are named by the same
prefix hashes and namespace as computed ones, so they are bit-for-bit what this engine would
have computed, and its tokens are those of a recompute.

A long prompt this replica lacks but does not ask a peer for is counted in
`qkv_kv_remote_fetch_skipped_total{reason}`: no other replica is said to hold more of it, apart
from peers shunned after a failure (none),
the index did not answer in time (index), or fetching was measured slower than computing (cost).
Each such prompt ends in exactly one of: fetched, a fallback, a skip.

A fetch that does not work out is never the request's failure: the prompt is computed here, and
`qkv_kv_remote_fetch_fallbacks_total{reason}` counts it: the peer is gone or failed
(unavailable; that peer is then not asked again for `PEER_BACKOFF_S`), it did not answer within
`timeout_s` (timeout), bytes that do not match their checksums (corrupt: those blocks and the
ones after them are computed, the ones before used), a peer that no longer held the blocks
(empty), or blocks of another model or layout (refused).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.replica.kv_connector import KVConnector, RayObjectStoreConnector, verified

logger = logging.getLogger(__name__)

INDEX_TIMEOUT_S = 0.25  # the index is a hint: a lookup that takes longer is skipped (computed here)
PEER_BACKOFF_S = 10.0  # a peer that failed is not asked again for this long (the index's ttl)
LINK_WEIGHT = 0.3  # the latest fetch's weight in the measured link rate


@dataclass(frozen=True)
class ToReplica:
    """The first argument of a handle call to the engine deployment that must reach one replica,
    named by its unique id: the prefix router (service/routing/router.py) sends it there, and to no
    other; while that replica is not running, the call waits (bounded here by `timeout_s`)."""

    replica_unique_id: str


class FetchCost:
    """Whether fetching blocks beats computing their tokens: the link rate measured over this
    replica's fetches (bytes over the whole call's seconds, so a call's fixed cost counts) against
    the engine's measured prefill rate."""

    def __init__(self) -> None:
        self.bytes_per_s: float | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s is None else (1 - LINK_WEIGHT) * self.bytes_per_s + LINK_WEIGHT * rate

    def fetch_seconds(self, nbytes: int) -> float | None:
        return None if self.bytes_per_s is None else nbytes / self.bytes_per_s

    def worth(self, nbytes: int, tokens: int, prefill_seconds_per_token: float | None) -> bool:
        """True when fetching `nbytes` is expected to take less time than computing `tokens`; with
        either rate not measured yet, True (the fetch measures the link)."""
        fetch = self.fetch_seconds(nbytes)
        if fetch is None or prefill_seconds_per_token is None:
            return True
        return fetch < tokens * prefill_seconds_per_token


class PeerFetch:
    """A replica's client of its peers' pools; `fetch(requests)` before the requests are queued."""

    def __init__(self, host: Any, kv_index: Any, peers: Callable[[], Any], replica_id: str, min_tokens: int,
                 timeout_s: float, connector: KVConnector | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """`peers()`: the engine deployment's handle (made on first use, inside the replica);
        `replica_id`: this replica's unique id, as the index knows it."""
        self.host, self.kv_index, self._peers = host, kv_index, peers
        self.replica_id, self.min_tokens, self.timeout_s = replica_id, min_tokens, timeout_s
        self.connector = connector or RayObjectStoreConnector()
        self.cost = FetchCost()
        self.skipped = 0  # prompts a peer held more of, computed here because that was expected to be faster
        self._clock = clock
        self._shunned: dict[str, float] = {}  # peer -> until when it is not asked
        self._handle: Any = None

    async def fetch(self, requests: list[Any]) -> None:
        """Fetch the blocks a peer holds of each distinct long prompt of `requests` (the choices of
        one HTTP request share theirs) that this replica's pool lacks, where that is faster."""
        prompts = {(tuple(r.prompt_token_ids), r.lora) for r in requests
                   if len(r.prompt_token_ids) >= self.min_tokens and getattr(r, "mm", None) is None}
        for prompt, lora in prompts:
            await self._fetch_one(list(prompt), lora)

    async def _fetch_one(self, prompt: list[int], lora: str | None) -> None:
        engine = self.host.engine
        if getattr(engine, "incoming", None) is None:  # no prefix cache: nothing to fetch into
            return
        held, full = engine.cached_prefix_blocks(prompt, lora)
        usable = min(full, (len(prompt) - 1) // engine.runtime.block_size)  # the last token is computed here
        if held >= usable:
            return
        try:
            runs = await asyncio.wait_for(self.kv_index.lookup.remote(prompt, lora), INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (a hint: the prompt is computed here)
            logger.debug("the KV index did not answer (%s); computing the prompt here", type(exc).__name__)
            self._skip("index")
            return
        now = self._clock()
        peers = {r: n for r, n in runs.items() if r != self.replica_id and self._shunned.get(r, 0.0) <= now}
        peer = max(peers, key=peers.__getitem__) if peers else None
        gain = 0 if peer is None else min(peers[peer], usable) - held
        if gain <= 0:
            self._skip("none")
            return
        block_nbytes = engine.incoming.pool.block_nbytes
        if not self.cost.worth(gain * block_nbytes, gain * engine.runtime.block_size,
                               getattr(engine, "prefill_seconds_per_token", None)):
            self.skipped += 1
            self._skip("cost")
            return
        await self._take(peer, prompt, lora)

    def _skip(self, reason: str) -> None:
        """A long prompt this replica lacks, computed here without asking a peer."""
        self.host.metrics.remote_fetch_skipped.inc(tags={"reason": reason})

    async def _take(self, peer: str, prompt: list[int], lora: str | None) -> None:
        metrics = self.host.metrics
        t0 = time.perf_counter()
        try:  # one bound for the peer's export and the move of its bytes
            blocks = await asyncio.wait_for(self._export_and_receive(peer, prompt, lora), self.timeout_s)
        except asyncio.CancelledError:  # the caller went away
            raise
        except asyncio.TimeoutError:
            self._fallback(peer, "timeout", shun=True)
            return
        except Exception as exc:  # noqa: BLE001 (the peer died, or failed: compute here)
            logger.warning("could not fetch KV blocks from replica %s (%s: %s); computing the prompt here", peer,
                           type(exc).__name__, exc)
            self._fallback(peer, "unavailable", shun=True)
            return
        if not blocks.keys:
            self._fallback(peer, "empty")
            return
        blocks, dropped = await verified(blocks)
        if dropped:
            logger.warning("%d of %d KV blocks from replica %s did not match their checksums; their tokens are "
                           "computed here", dropped, dropped + len(blocks.keys), peer)
            self._fallback(peer, "corrupt")
            if not blocks.keys:
                return
        taken = await self.host.loop.run_between_steps(functools.partial(self.host.engine.receive_prefix, blocks))
        if taken is not True:  # False: another namespace; an EngineFailure: the engine stopped
            self._fallback(peer, "refused")
            return
        seconds = time.perf_counter() - t0
        self.cost.observe(blocks.nbytes, seconds)
        metrics.remote_fetch_blocks.inc(len(blocks.keys))
        metrics.remote_fetch_bytes.inc(blocks.nbytes)
        metrics.remote_fetch_time.observe(seconds)

    async def _export_and_receive(self, peer: str, prompt: list[int], lora: str | None) -> Any:
        if self._handle is None:
            self._handle = self._peers()
        transfer = await self._handle.export_cached.remote(ToReplica(peer), prompt, lora)
        return await self.connector.receive(transfer)

    def _fallback(self, peer: str, reason: str, shun: bool = False) -> None:
        self.host.metrics.remote_fetch_fallbacks.inc(tags={"reason": reason})
        if shun:
            self._shunned[peer] = self._clock() + PEER_BACKOFF_S
