"""KV cache events: the prefix-cache blocks an engine made findable and those it gave up, by block
hash, collected between two drains (one per engine step): the shape of vLLM's KV events
(BlockStored, BlockRemoved, AllBlocksCleared in a batch with a timestamp), which an index of what
every replica holds (llm-d's, NVIDIA Dynamo's) routes on. No torch.

`medium` says which tier holds the block: "pool" (the device's paged pool), "host" or "disk" (the
engine's own offload tier, kv_offload_bytes, in host memory or in a file under kv_offload_dir).
The tier a node's replicas share (kv_share_dir) does not report: any engine of the node removes
its files, so no one engine knows what it holds; the prefix router reads that directory instead.
The offload tier's writer thread reports removals too, so the log takes a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one sequence's hash chain, in order, now findable in `medium`. `parent_block_hash`:
    the hash of the block before the first (None: the first blocks of a chain); `token_ids`: the
    tokens the blocks hold (empty when not known: blocks read back from a tier by hash)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    medium: str = "pool"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer findable in `medium` (their memory went to other tokens)."""

    block_hashes: tuple[bytes, ...]
    medium: str = "pool"


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of `medium` forgotten (a reset of the prefix cache)."""

    medium: str = "pool"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    ts: float  # seconds since the epoch, when the batch was drained
    events: tuple[KVEvent, ...]


@dataclass
class KVEventLog:
    """Events since the last `drain`, in the order they happened."""

    pending: list[KVEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, event: KVEvent) -> None:
        with self._lock:
            self.pending.append(event)

    def drain(self) -> KVEventBatch | None:
        """The events since the last drain as one batch, or None when there were none."""
        with self._lock:
            if not self.pending:
                return None
            events, self.pending = tuple(self.pending), []
        return KVEventBatch(time.time(), events)
