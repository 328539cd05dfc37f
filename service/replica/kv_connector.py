"""Prefill/decode disaggregation, the service's side (docs/features/pd-disaggregation.md): a
`Prefill` deployment computes prompts, and the engine replicas that decode them fetch the KV
blocks instead of prefilling.

The decode replica, before it queues a request whose prompt has at least `prefill_min_tokens`
tokens and whose full blocks its own pool does not all hold already, calls the prefill
deployment (`EngineReplica.prefill`, through a Serve handle: Serve picks the prefill replica).
That replica runs the prompt for one token, exports the prompt's
cached blocks (`Engine.export_prefix`) and hands them to its connector, which returns a
`KVTransfer`; the decode replica's connector turns it back into blocks, and its engine keeps them
for the request (`Engine.receive_prefix`), which then finds its prefix cached.

The connector is the seam where bytes move. `RayObjectStoreConnector` puts the blocks in Ray's
object store (shared memory on one node, Ray's transfer across nodes); a GPU build can put NIXL
or CUDA IPC behind the same two calls. A replica fetching a prefix from another replica
(service/replica/peer_fetch.py) uses the same connector. A prefill that fails (its replica died,
a transfer that does not arrive, a timeout) is not the request's failure: the decode replica
prefills the prompt itself, so the request is answered as without disaggregation
(`qkv_kv_transfers_total{outcome="failed"}` counts them). Each block travels with its CRC32
(`checksummed`); the decode replica keeps the leading blocks that check out (`verified`) and
computes the rest (`outcome="corrupt"`). Neither side keeps blocks for a transfer that did not
complete: the prefill replica's request ends (or is aborted when the caller goes away) like any
other, and the decode replica only keeps blocks that arrived whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import torch

from model.engine.kv.transfer import KVBlocks, block_checksums

logger = logging.getLogger(__name__)


@dataclass
class KVTransfer:
    """What a prefill replica returns: the blocks' keys and where their bytes are."""

    keys: list[bytes]
    block_nbytes: int
    namespace: str
    payload: Any  # the connector's: an ObjectRef for RayObjectStoreConnector
    checksums: list[int] | None = None  # each block's CRC32 (model/engine/kv/transfer.py)

    @property
    def nbytes(self) -> int:
        return len(self.keys) * self.block_nbytes


class KVConnector(Protocol):
    """Moves exported blocks from a prefill replica to a decode replica."""

    def send(self, blocks: KVBlocks) -> KVTransfer: ...

    async def receive(self, transfer: KVTransfer) -> KVBlocks: ...


class RayObjectStoreConnector:
    """The blocks' bytes as one object in Ray's object store, owned by the prefill replica."""

    def send(self, blocks: KVBlocks) -> KVTransfer:
        return KVTransfer(blocks.keys, blocks.block_nbytes, blocks.namespace, ray.put(blocks.data.numpy()),
                          blocks.checksums)

    async def receive(self, transfer: KVTransfer) -> KVBlocks:
        array = await transfer.payload  # raises if the owner (the prefill replica) died meanwhile
        data = torch.from_numpy(array.copy())  # out of the store: the object may be freed after this
        if data.numel() != transfer.nbytes:
            raise ValueError(f"received {data.numel()} bytes of KV blocks, expected {transfer.nbytes}")
        return KVBlocks(transfer.keys, data, transfer.block_nbytes, transfer.namespace, transfer.checksums)


async def checksummed(blocks: KVBlocks) -> KVBlocks:
    """`blocks` with each block's CRC32, computed off the event loop (zlib releases the GIL)."""
    if not blocks.keys:
        return dataclasses.replace(blocks, checksums=[])
    checksums = await asyncio.to_thread(block_checksums, blocks.data, blocks.block_nbytes)
    return dataclasses.replace(blocks, checksums=checksums)


async def verified(blocks: KVBlocks) -> tuple[KVBlocks, int]:
    """`KVBlocks.verified` off the event loop: the leading blocks whose bytes check out, and how many
    were dropped."""
    if blocks.checksums is None or not blocks.keys:
        return blocks, 0
    return await asyncio.to_thread(blocks.verified)


class RemotePrefill:
    """A decode replica's client of the prefill deployment."""

    def __init__(self, handle: Any, host: Any, min_tokens: int, timeout_s: float,
                 connector: KVConnector | None = None) -> None:
        self.handle, self.host = handle, host
        self.min_tokens, self.timeout_s = min_tokens, timeout_s
        self.connector = connector or RayObjectStoreConnector()

    async def fetch(self, requests: list[Any]) -> None:
        """Get the blocks of each distinct long prompt of `requests` (the choices of one HTTP
        request share theirs) into this replica's engine; a failure leaves the prompt to be
        prefilled here. A prompt with images is prefilled here: the prefill deployment takes token
        ids only, and blocks computed without the images would never match its block hashes."""
        prompts = {(tuple(r.prompt_token_ids), r.lora) for r in requests
                   if len(r.prompt_token_ids) >= self.min_tokens and getattr(r, "mm", None) is None}
        for prompt, lora in prompts:
            held, full = self.host.engine.cached_prefix_blocks(list(prompt), lora)
            if held >= full:  # this replica's pool holds every block a prefill would send
                self.host.metrics.transfers.inc(tags={"outcome": "cached"})
                continue
            await self._fetch_one(list(prompt), lora)

    async def _fetch_one(self, prompt: list[int], lora: str | None) -> None:
        metrics = self.host.metrics
        t0 = time.perf_counter()
        try:
            transfer = await asyncio.wait_for(self._prefill(prompt, lora), self.timeout_s)
            t1 = time.perf_counter()
            blocks = await asyncio.wait_for(self.connector.receive(transfer), self.timeout_s)
        except asyncio.CancelledError:  # the caller went away: Serve cancels the prefill replica's call too
            raise
        except Exception as exc:  # noqa: BLE001 (any failure of the remote side: prefill here instead)
            logger.warning("prefill deployment failed (%s: %s); prefilling the prompt of %d tokens here",
                           type(exc).__name__, exc, len(prompt))
            metrics.transfers.inc(tags={"outcome": "failed"})
            return
        blocks, dropped = await verified(blocks)
        if dropped:
            logger.warning("%d of %d KV blocks from the prefill deployment did not match their checksums; "
                           "their tokens are computed here", dropped, dropped + len(blocks.keys))
        taken = await self.host.loop.run_between_steps(functools.partial(self.host.engine.receive_prefix, blocks))
        metrics.transfers.inc(tags={"outcome": "corrupt" if dropped else "received" if taken else "refused"})
        if taken:
            metrics.transfer_bytes.inc(blocks.nbytes)
            metrics.transfer_fetch_time.inc(time.perf_counter() - t1)
            metrics.transfer_time.observe(time.perf_counter() - t0)
        else:
            logger.warning("blocks from the prefill deployment are not this engine's (namespace %s, this engine's "
                           "%s): are both deployments the same model, dtype and block size?",
                           blocks.namespace, getattr(self.host.engine, "kv_namespace", None))

    async def _prefill(self, prompt: list[int], lora: str | None) -> KVTransfer:
        return await self.handle.prefill.remote(prompt, lora)
