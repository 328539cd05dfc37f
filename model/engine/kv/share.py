"""Prefixes shared across replicas: a directory the engines of one node share (`kv_share_dir`, e.g.
on /dev/shm), holding one file per KV block named by the block's prefix hash. An engine writes
each prompt block it computes there, and any other block when its pool evicts it (in the
background, once per block whatever the number of engines), and a prompt whose prefix runs past
the engine's own pool continues with the blocks it finds there, copied in instead of recomputed:
a prefix computed by one replica is loaded by the others (docs/features/kv-share.md).

The block manager (torch-free) calls it by block hash, as it calls the private tier
(kv_offload.py): `publish(block, key)` when a prompt block is computed, `save(block, key)` when
it evicts one (stored if no engine stored it yet), `has(key)` and `load(key, block)`. The prefix
router (service/routing/router.py) looks for the same files to know which prefixes every replica
can load (kv_share_layout.py, torch-free, says where they are and how they are laid out).

Files live under `<kv_share_dir>/<namespace>/`: the namespace is a hash of the engine's salt (its
model, config and dtype) and of the block's layout (each layer's shape and dtype of K and V), so
engines of different models, dtypes or block sizes never read each other's blocks. Each file is a
header (magic, the block's hash, the payload's length and CRC32) and the block's bytes; a file is
written under a temporary name and renamed into place, so a reader sees a whole block or none. A
file that does not check out (corrupt, truncated, another layout) is removed with a warning and
its tokens are recomputed; a write that fails (a full disk) drops the block the same way.

Size: the engines keep the directory near `kv_share_bytes` by removing the files least recently
written or read (a read touches its file). Each engine counts its own writes between scans of the
directory, so with R engines writing at once it can exceed the size by about R x 10%.
"""

from __future__ import annotations

import logging
import os
import time
import zlib

import torch

from model.engine.kv.offload import MAX_PENDING, WriterTier
from model.engine.kv.share_layout import HEADER, MAGIC, block_file

TRIM_TO = 0.9  # a scan over the size removes files down to this share of it

logger = logging.getLogger(__name__)


class SharedTier(WriterTier):
    """The shared tier of an engine whose pool is `tensors` (every layer's K and V pools)."""

    def __init__(self, tensors: list[torch.Tensor], directory: str, capacity_bytes: int, name: str) -> None:
        """`name`: the namespace of the engine's blocks (kv_share_layout.namespace), its subdirectory."""
        super().__init__(tensors, "kv-share-writer")
        self.file_nbytes = HEADER.size + self.block_nbytes
        if capacity_bytes < self.file_nbytes:
            raise ValueError(f"kv_share_bytes={capacity_bytes} is smaller than one KV block "
                             f"({self.file_nbytes} bytes with its header)")
        self.capacity_bytes = capacity_bytes
        self.directory = os.path.join(directory, name)
        os.makedirs(self.directory, exist_ok=True)
        self._read_buffer = bytearray(self.file_nbytes + 1)  # one byte over: a longer file is not this block's
        self._staged: dict[bytes, torch.Tensor] = {}  # published here, not yet written
        self._since_scan = 0  # bytes this engine wrote since it last measured the directory
        self._scanned = self._trim()  # bytes in the directory at that scan
        self._writer.start()
        logger.info("KV shared tier: %s (%d blocks of %d bytes at most)", self.directory,
                    capacity_bytes // self.file_nbytes, self.block_nbytes)

    # ---- the block manager's calls (the engine's thread) -----------------------------

    def publish(self, block: int, key: bytes) -> None:
        """Store pool block `block` under `key` unless an engine already did (written in the background)."""
        with self._lock:
            if key in self._staged:
                return
            if os.path.exists(block_file(self.directory, key)):
                return
            if self._queue.qsize() >= MAX_PENDING:
                self.stats.skipped_blocks += 1
                return
            data = self.pool.copy_out(block)
            self._staged[key] = data
        self._queue.put((key, data))

    save = publish  # an evicted block: the same (a block published before is not written again)

    def has(self, key: bytes) -> bool:
        with self._lock:
            if key in self._staged:
                return True
        return os.path.exists(block_file(self.directory, key))

    def load(self, key: bytes, block: int) -> bool:
        """Copy the block stored under `key` into pool block `block`; False when it is not there or
        did not check out (then its file is removed, and the caller recomputes)."""
        t0 = time.perf_counter()
        with self._lock:
            data = self._staged.get(key)
        if data is None:
            data = self._read(key)
            if data is None:
                return False
        return self._loaded(block, data, t0)

    def read(self, key: bytes) -> torch.Tensor | None:
        """The bytes of the block stored under `key` (host, uint8, its own copy), or None as `load`."""
        with self._lock:
            data = self._staged.get(key)
        if data is None:
            data = self._read(key)
            return None if data is None else data.clone()
        return data

    # ---- internals ----------------------------------------------------------------

    def _read(self, key: bytes) -> torch.Tensor | None:
        path = block_file(self.directory, key)
        raw = self._read_buffer  # reused: a fresh one costs its page faults on every block
        try:
            with open(path, "rb") as f:
                size = f.readinto(raw)
        except FileNotFoundError:  # removed by an engine trimming the directory since `has`
            return None
        except OSError as exc:
            return self._reject(path, f"unreadable ({exc})")
        if size != self.file_nbytes:
            return self._reject(path, f"{size} bytes, not {self.file_nbytes}")
        magic, stored_key, nbytes, crc = HEADER.unpack_from(raw)
        if magic != MAGIC or stored_key != key or nbytes != self.block_nbytes:
            return self._reject(path, "not this block's header")
        if zlib.crc32(memoryview(raw)[HEADER.size:size]) != crc:
            return self._reject(path, "checksum mismatch")
        try:
            os.utime(path)  # recently used: trimmed last
        except OSError:
            pass
        # A view of the reused buffer: `load` copies it into the pool before the next read.
        return torch.frombuffer(raw, dtype=torch.uint8, offset=HEADER.size, count=self.block_nbytes)

    def _reject(self, path: str, why: str) -> None:
        """Remove a block file that did not check out (the caller then returns None: recompute)."""
        logger.warning("KV shared tier: %s did not read back (%s); removed, its tokens are recomputed", path, why)
        self.stats.errors += 1
        try:
            os.unlink(path)
        except OSError:
            pass

    def _write(self, key: bytes, data: torch.Tensor) -> None:
        path = block_file(self.directory, key)
        tmp = os.path.join(self.directory, f".{key.hex()}.{os.getpid()}.{id(self):x}.tmp")  # one per engine
        payload = memoryview(data.numpy())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            header = HEADER.pack(MAGIC, key, self.block_nbytes, zlib.crc32(payload))
            for part in (header, payload):
                view, done = memoryview(part).cast("B"), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)  # whole or absent to readers; a block two engines wrote is the same bytes

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data = item
            try:
                self._write(key, data)
            except Exception as exc:  # noqa: BLE001 (the writer must outlive any one block: it drops it)
                logger.warning("KV shared tier: writing a block failed (%s); dropped, it will be recomputed", exc)
                with self._lock:
                    self.stats.errors += 1
            else:
                with self._lock:
                    self.stats.saved_blocks += 1
                    self.stats.bytes_written += self.block_nbytes
                self._since_scan += self.file_nbytes
                if self._scanned + self._since_scan > self.capacity_bytes:
                    self._scanned, self._since_scan = self._trim(), 0
            finally:
                with self._lock:
                    if self._staged.get(key) is data:
                        del self._staged[key]
                self._queue.task_done()
        self._queue.task_done()

    def _trim(self) -> int:
        """Remove the least recently used files while the directory holds more than its size (down to
        TRIM_TO of it); returns the bytes left."""
        files = []
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name.startswith("."):  # another engine's write in progress
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        if total <= self.capacity_bytes:
            return total
        files.sort()
        for _, size, path in files:
            if total <= TRIM_TO * self.capacity_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
        return total


class Tiers:
    """The private offload tier and the shared tier together: a prefix continues in the first that
    has its next block; an evicted block goes to both."""

    def __init__(self, *tiers) -> None:
        self.tiers = tiers

    def save(self, block: int, key: bytes) -> None:
        for tier in self.tiers:
            tier.save(block, key)

    def publish(self, block: int, key: bytes) -> None:
        for tier in self.tiers:
            tier.publish(block, key)

    def has(self, key: bytes) -> bool:
        return any(tier.has(key) for tier in self.tiers)

    def load(self, key: bytes, block: int) -> bool:
        return any(tier.has(key) and tier.load(key, block) for tier in self.tiers)
