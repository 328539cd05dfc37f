"""Prefill/decode disaggregation, the engine's side: a prefill engine exports the KV blocks of a
prompt it computed, and a decode engine receives them and serves the prompt from them as prefix
cache hits (docs/features/pd-disaggregation.md). How the bytes travel between processes is the
service's connector (service/replica/kv_connector.py: Ray's object store); the engine only turns
blocks into one byte tensor and back.

A transfer is the prompt's run of leading full blocks still cached in the prefill engine's pool,
keyed by their prefix hashes, and the namespace of the engine's blocks (model, config, dtype and
block layout, as the shared tier names it: model/engine/kv/share_layout.py). The decode engine
takes a transfer only when the namespace is its own; its blocks then wait in `IncomingBlocks`, a
tier the block manager consults after its pool (as it consults the offload tiers), and are copied
into the pool when the request is admitted: its prefix runs through them as through blocks it
computed itself. The decode engine computes the rest (the last partial block and at least the
prompt's last token) and samples the first token itself, so its tokens are those of colocated
serving.

The same blocks serve a cross-node prefix fetch (service/replica/peer_fetch.py): a replica takes
from a peer the blocks the peer's pool holds of a prompt. Either way each block travels with the
CRC32 of its bytes (`block_checksums`), and the receiver keeps the leading blocks that check out
(`KVBlocks.verified`): a block damaged on the way, and every block after it, is recomputed.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.engine.kv.offload import PoolBlocks


@dataclass
class KVBlocks:
    """The exported blocks of one prompt: `keys[i]` is block i's prefix hash, `data` the blocks'
    bytes one after the other (`block_nbytes` each), `namespace` what they are valid for."""

    keys: list[bytes]
    data: torch.Tensor  # uint8, on the host
    block_nbytes: int
    namespace: str
    checksums: list[int] | None = None  # CRC32 of each block's bytes, by the sender (None: not checked)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_nbytes

    def verified(self) -> tuple[KVBlocks, int]:
        """These blocks up to the first whose bytes do not match its checksum (or are missing), and
        how many were dropped: a prefix must run through whole, computed blocks only."""
        if self.checksums is None:
            return self, 0
        good, n = 0, self.block_nbytes
        if len(self.checksums) == len(self.keys) and self.data.numel() == self.nbytes:
            array = self.data.numpy()
            while good < len(self.keys) and zlib.crc32(array[good * n:(good + 1) * n]) == self.checksums[good]:
                good += 1
        if good == len(self.keys):
            return self, 0
        kept = KVBlocks(self.keys[:good], self.data[:good * n], n, self.namespace, self.checksums[:good])
        return kept, len(self.keys) - good


def block_checksums(data: torch.Tensor, block_nbytes: int) -> list[int]:
    """The CRC32 of each `block_nbytes` of `data` (host, uint8), as `KVBlocks.verified` checks them.
    zlib releases the GIL for a buffer this large, so a caller may run it on a thread."""
    array = data.numpy()
    return [zlib.crc32(array[i:i + block_nbytes]) for i in range(0, array.size, block_nbytes)]


class IncomingBlocks:
    """Blocks received for requests not yet admitted, by key; a tier of the block manager that only
    loads. It holds the last `max_transfers` transfers: an older one whose request has not been
    admitted yet is dropped (that request recomputes its prompt)."""

    def __init__(self, pool: PoolBlocks, max_transfers: int = 16) -> None:
        self.pool = pool
        self.max_transfers = max_transfers
        self._transfers: OrderedDict[int, dict[bytes, torch.Tensor]] = OrderedDict()
        self._where: dict[bytes, int] = {}  # key -> the transfer that holds it
        self._next = 0
        self.loaded_blocks = 0  # copied into the pool, since start
        self.load_seconds = 0.0

    def add(self, blocks: KVBlocks) -> None:
        if blocks.block_nbytes != self.pool.block_nbytes:
            raise ValueError(f"blocks of {blocks.block_nbytes} bytes, this pool's are {self.pool.block_nbytes}")
        n = blocks.block_nbytes
        data = blocks.data
        if self.pool.device.type == "cuda" and not data.is_pinned():
            data = data.pin_memory()  # each block's copy to the GPU at admission then runs at full speed
        entries = {key: data[i * n:(i + 1) * n] for i, key in enumerate(blocks.keys)}
        self._transfers[self._next] = entries
        for key in entries:
            self._where[key] = self._next
        self._next += 1
        while len(self._transfers) > self.max_transfers:
            index, old = self._transfers.popitem(last=False)
            for key in old:
                if self._where.get(key) == index:  # not taken over by a later transfer of the same block
                    del self._where[key]

    def save(self, block: int, key: bytes) -> None:
        pass

    def publish(self, block: int, key: bytes) -> None:
        pass

    def has(self, key: bytes) -> bool:
        return key in self._where

    def load(self, key: bytes, block: int) -> bool:
        """Copy the received block into pool block `block`; the pool holds it from now on."""
        index = self._where.pop(key, None)
        if index is None:
            return False
        t0 = time.perf_counter()
        data = self._transfers[index].pop(key)
        if not self._transfers[index]:
            del self._transfers[index]
        self.pool.copy_in(block, data)
        self.loaded_blocks += 1
        self.load_seconds += time.perf_counter() - t0
        return True

    @property
    def num_blocks(self) -> int:
        return len(self._where)
