"""The prefix cache's second tier: KV blocks evicted from the pool are kept in host memory or in
a file on a local disk, and a prefix found there is copied back into the pool instead of being
recomputed (`kv_offload_bytes`, `kv_offload_dir`; docs/features/kv-offload.md).

The block manager (torch-free) calls three methods, by block hash, the key its prefix cache uses:
`save(block, key)` when it evicts a cached block, `has(key)` and `load(key, block)` when a
sequence's prefix runs past the pool's blocks. A saved block is copied out of the pool at once
(the pool reuses the block in the same step) into a staging buffer; a background thread writes it
to its slot, so the step never waits on the disk. A block still being written is read from its
staging buffer.

Exactness: a block is stored under the hash of every token before and in it (salted with the
model, the adapter and the rotation regime), so what comes back is what the pool held. The disk
tier keeps a CRC32 of each slot and checks it on every read: a slot that does not read back as
written (a disk error, a file changed underneath) is dropped with a warning and its tokens are
recomputed, never used. A write that fails (the disk is full) drops that block the same way.
The file is unlinked as soon as it is opened: it takes no space after the process ends.

With KV events on (`events`), the tier reports what it holds as the pool does, under the medium
"host" or "disk": a block stored when it is saved (it can be loaded from then on, from its staging
buffer until written), removed when the tier evicts or drops it. A peer exports from the tier
too (`read`), so the cluster's index may point another replica at a block that is here only.
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.engine.kv.events import BlockRemoved, BlockStored, KVEventLog

logger = logging.getLogger(__name__)

# Blocks copied out but not yet written: past this the tier skips an evicted block instead of
# holding more memory for a writer that cannot keep up (the step never waits on it).
MAX_PENDING = 256


@dataclass
class OffloadStats:
    """Totals since start (the engine reports them in EngineStats)."""

    saved_blocks: int = 0  # blocks written to the tier
    loaded_blocks: int = 0  # blocks copied back into the pool (tier hits)
    bytes_written: int = 0
    bytes_read: int = 0
    load_seconds: float = 0.0  # time the engine spent copying blocks back
    errors: int = 0  # writes that failed and reads that did not check out, each dropped
    skipped_blocks: int = 0  # evicted while the writer was MAX_PENDING blocks behind: not saved


class HostStore:
    """Slots in host memory: each holds the block's own copy out of the pool (no second copy)."""

    checksums = False  # memory the process owns does not change underneath it

    def __init__(self, slots: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * slots

    def write(self, slot: int, data: torch.Tensor) -> None:
        self.slots[slot] = data

    def read(self, slot: int) -> torch.Tensor:
        data = self.slots[slot]
        if data is None:
            raise OSError(f"slot {slot} is empty")
        return data

    def close(self) -> None:
        self.slots = []


class DiskStore:
    """Slots in one file under `directory`, written and read with pwrite/pread (a full disk is an
    OSError on one write, not a fault in a mapped page)."""

    checksums = True

    def __init__(self, directory: str, nbytes: int) -> None:
        os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="qkv-kv-offload-", suffix=".bin", dir=directory)
        os.unlink(path)  # the space goes back when the process ends, whatever the end
        self.fd, self.path, self.nbytes = fd, path, nbytes

    def write(self, slot: int, data: torch.Tensor) -> None:
        view = memoryview(data.numpy())
        done = os.pwrite(self.fd, view, slot * self.nbytes)
        if done != self.nbytes:
            raise OSError(f"short write: {done} of {self.nbytes} bytes")

    def read(self, slot: int) -> torch.Tensor:
        data = os.pread(self.fd, self.nbytes, slot * self.nbytes)
        if len(data) != self.nbytes:
            raise OSError(f"short read: {len(data)} of {self.nbytes} bytes")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PoolBlocks:
    """One pool block as bytes: every layer's K and V of it (`tensors`: the pools; dim 0 is the
    block), copied out to the host and back in."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.device = tensors[0].device
        self._sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.block_nbytes = sum(self._sizes)

    def copy_out(self, block: int) -> torch.Tensor:
        parts = [t[block].reshape(-1).view(torch.uint8) for t in self.tensors]  # each (block bytes,)
        return torch.cat(parts).to("cpu")

    def copy_out_many(self, blocks: list[int]) -> torch.Tensor:
        """`copy_out` of each of `blocks`, one after the other in one host tensor: one gather per
        pool tensor (on the pool's device) instead of one copy per block and tensor, and on a GPU
        one copy to the host, into pinned memory."""
        n = len(blocks)
        out = torch.empty(n, self.block_nbytes, dtype=torch.uint8, device=self.device)
        if n:
            index = torch.tensor(blocks, device=self.device)
            offset = 0
            for t in self.tensors:
                part = t.index_select(0, index).view(n, -1).view(torch.uint8)
                out[:, offset:offset + part.shape[1]].copy_(part)
                offset += part.shape[1]
        if self.device.type == "cpu":
            return out.view(-1)
        host = torch.empty(n * self.block_nbytes, dtype=torch.uint8, pin_memory=True)
        return host.copy_(out.view(-1))

    def copy_in(self, block: int, data: torch.Tensor) -> None:
        data = data.to(self.device)  # synchronous: the buffer may be written again after this
        # One multi-tensor copy (a kernel or two on a GPU, not one per layer's K and V).
        torch._foreach_copy_([t[block].view(-1).view(torch.uint8) for t in self.tensors],
                             list(torch.split(data, self._sizes)))


class WriterTier:
    """What the offload tiers share: the pool's blocks as bytes, their totals, and a writer thread
    fed by a queue, so the step never waits on a write. A subclass defines `_write_loop` and starts
    `_writer` once it is set up."""

    def __init__(self, tensors: list[torch.Tensor], writer_name: str) -> None:
        self.pool = PoolBlocks(tensors)
        self.block_nbytes = self.pool.block_nbytes
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name=writer_name, daemon=True)

    def _write_loop(self) -> None:
        raise NotImplementedError

    def _loaded(self, block: int, data: torch.Tensor, t0: float) -> bool:
        """Copy `data` into pool block `block` and count the hit that began at `t0`."""
        self.pool.copy_in(block, data)
        self.stats.loaded_blocks += 1
        self.stats.bytes_read += self.block_nbytes
        self.stats.load_seconds += time.perf_counter() - t0
        return True

    def close(self) -> None:
        """Stop the writer (after what it holds)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)

    def flush(self) -> None:
        """Wait until every block handed to the writer is written (tests, benchmarks, shutdown)."""
        self._queue.join()


class KVOffload(WriterTier):
    """The tier over the pool `tensors` (every layer's K and V pools; dim 0 is the block)."""

    def __init__(self, tensors: list[torch.Tensor], capacity_bytes: int, directory: str | None = None,
                 events: KVEventLog | None = None, block_size: int = 0) -> None:
        """`events`: where to report the blocks stored and removed (None: not reported);
        `block_size`: tokens per block, for those reports."""
        super().__init__(tensors, "kv-offload-writer")
        self.events, self.block_size = events, block_size
        self.medium = "host" if directory is None else "disk"
        self.num_slots = capacity_bytes // self.block_nbytes
        if self.num_slots < 1:
            raise ValueError(f"kv_offload_bytes={capacity_bytes} is smaller than one KV block "
                             f"({self.block_nbytes} bytes)")
        self.store = (DiskStore(directory, self.block_nbytes) if directory is not None else
                      HostStore(self.num_slots))
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._crc: list[int | None] = [None] * self.num_slots
        self._staged: dict[bytes, torch.Tensor] = {}  # saved, not yet written
        self._writer.start()
        logger.info("KV offload tier: %d blocks of %d bytes in %s", self.num_slots, self.block_nbytes,
                    f"a file under {directory}" if directory is not None else "host memory")

    # ---- the block manager's calls (the engine's thread) -----------------------------

    def save(self, block: int, key: bytes) -> None:
        """Copy pool block `block` out now and store it under `key` (written in the background)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if self._queue.qsize() >= MAX_PENDING:  # each queued block holds its copy
                self.stats.skipped_blocks += 1
                return
            slot = self._free.pop() if self._free else self._evict_oldest()
            self._index[key] = slot
            self._crc[slot] = None
            data = self.pool.copy_out(block)
            self._staged[key] = data
            if self.events is not None:  # under the lock: in the order the writer's drops see
                self.events.add(BlockStored((key,), None, (), self.block_size, None, self.medium))
        self._queue.put((key, slot, data))

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def publish(self, block: int, key: bytes) -> None:
        """A prompt block just computed: kept in the pool; this tier takes it when it is evicted."""

    def load(self, key: bytes, block: int) -> bool:
        """Copy the block stored under `key` into pool block `block`; False when it is not there
        or did not read back as written (then it is dropped, and the caller recomputes)."""
        t0 = time.perf_counter()
        data = self.read(key)
        return data is not None and self._loaded(block, data, t0)

    def read(self, key: bytes) -> torch.Tensor | None:
        """The bytes of the block stored under `key` (host, uint8; valid until the engine's thread
        saves again), or None when it is not there or did not read back as written (then it is
        dropped)."""
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                return None
            self._index.move_to_end(key)
            data, crc = self._staged.get(key), self._crc[slot]
        if data is None:
            try:
                data = self.store.read(slot)
                if self.store.checksums and (crc is None or zlib.crc32(data.numpy()) != crc):
                    raise OSError("checksum mismatch")
            except (OSError, RuntimeError, ValueError) as exc:
                logger.warning("KV offload: block in slot %d did not read back (%s); dropped, its tokens are "
                               "recomputed", slot, exc)
                self._drop(key, slot)
                return None
        return data

    def close(self) -> None:
        """Stop the writer (after what it holds) and release the store."""
        super().close()
        self.store.close()

    # ---- internals ----------------------------------------------------------------

    def _evict_oldest(self) -> int:
        key, slot = self._index.popitem(last=False)
        self._staged.pop(key, None)
        self._removed(key)
        return slot

    def _removed(self, key: bytes) -> None:
        """Report `key` no longer held here (the caller holds the lock)."""
        if self.events is not None:
            self.events.add(BlockRemoved((key,), self.medium))

    def _drop(self, key: bytes, slot: int) -> None:
        with self._lock:
            self.stats.errors += 1
            if self._index.get(key) == slot:
                del self._index[key]
                self._staged.pop(key, None)
                self._crc[slot] = None
                self._free.append(slot)
                self._removed(key)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, slot, data = item
            try:
                crc = zlib.crc32(data.numpy()) if self.store.checksums else 0
                self.store.write(slot, data)
            except Exception as exc:  # noqa: BLE001 (the writer must outlive any one block: it drops it)
                logger.warning("KV offload: writing a block failed (%s); dropped, its tokens will be recomputed", exc)
                self._drop(key, slot)
            else:
                with self._lock:
                    if self._index.get(key) == slot:  # not evicted again meanwhile
                        self._crc[slot] = crc
                        if self._staged.get(key) is data:
                            del self._staged[key]
                    self.stats.saved_blocks += 1
                    self.stats.bytes_written += self.block_nbytes
            finally:
                self._queue.task_done()
        self._queue.task_done()
