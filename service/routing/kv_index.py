"""A cluster-wide index of the KV cache: which replicas hold each prefix-cache block, and in which
tier, built from the KV events the engines publish (model/engine/kv/events.py: BlockStored,
BlockRemoved, AllBlocksCleared, vLLM's shape), as llm-d's and NVIDIA Dynamo's indexers are.

What the index knows is what the replicas said: a replica's events arrive in order (one
publisher per replica), and a replica that has not been heard from for `ttl_s` (it died, or its
node went away) is forgotten, so a router never prefers a replica that is gone for longer than
that. A replica that restarts publishes under a new id, or clears its own entries (`forget`)
when it starts: it starts empty either way.

Plain Python, no Ray: the app's `KVIndex` deployment holds one (service/routing/kv_index_deployment.py),
and the prefix route asks it, for each request, how many of the prompt's leading blocks each
replica holds (`lookup`: the prompt hashed as each replica's engine hashes it, from the block size
and salt the replica published with its events).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from model.engine.kv.block_manager import block_hashes, sequence_salt
from model.engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# How a replica's engine hashes a prompt: (block size, the engine's prefix salt in hex).
Layout = tuple[int, str]


class KVIndex:
    """Block hash -> {replica: the tiers ("pool", ...) that hold it}, from the replicas' events."""

    def __init__(self, ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._holders: dict[bytes, dict[str, set[str]]] = {}
        self._held: dict[str, set[bytes]] = {}  # replica -> the hashes it holds in any tier
        self._heard: dict[str, float] = {}  # replica -> when it last published (`clock`)
        self._layout: dict[str, Layout] = {}  # replica -> how its engine hashes prompts
        self.events_applied = 0

    # ---- what the replicas send --------------------------------------------------------------

    def publish(self, replica: str, batches: Iterable[KVEventBatch] = (), layout: Layout | None = None) -> None:
        """Apply `replica`'s event batches, in order; with none, a heartbeat (it is alive and has
        nothing new). `layout`: how its engine hashes prompts (for `lookup`)."""
        self._heard[replica] = self.clock()
        if layout is not None:
            self._layout[replica] = (int(layout[0]), str(layout[1]))
        self._held.setdefault(replica, set())
        for batch in batches:
            for event in batch.events:
                self._apply(replica, event)
                self.events_applied += 1

    def forget(self, replica: str) -> None:
        """Drop everything `replica` holds (it died, or restarted empty)."""
        for h in self._held.pop(replica, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self._holders[h]
        self._heard.pop(replica, None)
        self._layout.pop(replica, None)

    def expire(self) -> list[str]:
        """Forget the replicas not heard from for `ttl_s`; the ones forgotten."""
        now = self.clock()
        gone = [r for r, at in self._heard.items() if now - at > self.ttl_s]
        for replica in gone:
            self.forget(replica)
        return gone

    # ---- what the router asks ----------------------------------------------------------------

    def prefix_runs(self, hashes: list[bytes], tiers: Iterable[str] | None = None) -> dict[str, int]:
        """For each live replica that holds the first block: how many of `hashes`' leading blocks
        it holds (in `tiers`, default any), in order, stopping at the first it lacks."""
        self.expire()
        return self._runs(hashes, tiers)

    def _runs(self, hashes: list[bytes], tiers: Iterable[str] | None = None) -> dict[str, int]:
        """`prefix_runs` over the replicas as they are (the caller has expired the silent ones)."""
        wanted = None if tiers is None else set(tiers)
        runs: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, {})
            here = {r for r, media in holders.items() if wanted is None or media & wanted}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for replica in alive:
                runs[replica] = i + 1
        return runs

    def lookup(self, prompt_token_ids: list[int], lora: str | None = None,
               tiers: Iterable[str] | None = None) -> dict[str, int]:
        """For each live replica holding the prompt's first full block: how many of its leading full
        blocks it holds, in `tiers` (default any), the prompt hashed as that replica's engine hashes
        it (under `lora`, as the engine salts an adapter's blocks). Replicas that published no
        layout are not asked about."""
        self.expire()
        runs: dict[str, int] = {}
        for size, salt in set(self._layout.values()):
            keys = block_hashes(prompt_token_ids, size, sequence_salt(bytes.fromhex(salt), lora))
            same = {r for r, layout in self._layout.items() if layout == (size, salt)}
            runs.update({r: n for r, n in self._runs(keys, tiers).items() if r in same})
        return runs

    def replicas(self) -> dict[str, int]:
        """Each live replica and how many blocks it holds."""
        self.expire()
        return {r: len(held) for r, held in self._held.items()}

    def stats(self) -> dict[str, Any]:
        return {"replicas": len(self._held), "blocks": len(self._holders), "events_applied": self.events_applied}

    # ---- inside ------------------------------------------------------------------------------

    def _apply(self, replica: str, event: Any) -> None:
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                self._holders.setdefault(h, {}).setdefault(replica, set()).add(event.medium)
                self._held[replica].add(h)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._drop(replica, h, event.medium)
        elif isinstance(event, AllBlocksCleared):
            for h in list(self._held.get(replica, ())):
                self._drop(replica, h, event.medium)
        else:
            raise TypeError(f"not a KV event: {type(event).__name__}")

    def _drop(self, replica: str, h: bytes, medium: str) -> None:
        holders = self._holders.get(h)
        media = None if holders is None else holders.get(replica)
        if media is None:
            return  # removed before it was stored here (events from before the replica was forgotten)
        media.discard(medium)
        if not media:
            del holders[replica]
            self._held[replica].discard(h)
            if not holders:
                del self._holders[h]
