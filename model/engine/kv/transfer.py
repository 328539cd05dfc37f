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
"""

from __future__ import annotations

import time
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

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_nbytes


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
