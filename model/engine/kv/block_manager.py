"""Accounting of the paged KV pool: which blocks are free, which sequence holds which, and
(with prefix caching) which full blocks hold which tokens. No torch.

Prefix caching: a full block is named by a hash chained from its parent block's hash and its
own token ids (`block_hashes`), seeded with a per-engine salt (the model identity, since the
K/V of a token depend on the weights and the attention kind). A block enters the cache only
once its K/V are computed (`commit`), so a block still being written is never shared. Blocks
are reference-counted; one whose count drops to zero keeps its contents and stays findable
until the pool needs its memory: plain free blocks are used first, then cached ones are
evicted least recently used first, and of one sequence the tail of the chain before its head.

A second tier (`tier`, model/engine/kv/offload.py): a cached block evicted from the pool is saved
there under its hash, and `match` continues a prefix past the pool's blocks with the tier's, each
copied into a pool block and cached there as if it had been computed.

Sliding windows: when every layer is windowed, a sequence's leading blocks that no future query
can see are given back as decoding moves on (`release_out_of_window`); their table entries become
`null_block`, an id outside the pool (the engine's scratch block, which every attention path may
read under a mask and none attends to), so table positions, and all arithmetic on them, stay put.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from model.engine.kv.events import BlockRemoved, BlockStored, KVEventLog
from model.engine.sequence import Sequence


class BlockTier(Protocol):
    """Where evicted cached blocks go, by hash (model/engine/kv/offload.py's KVOffload, and
    model/engine/kv/share.py's tier shared by the replicas of a node)."""

    def save(self, block: int, key: bytes) -> None: ...

    def has(self, key: bytes) -> bool: ...

    def load(self, key: bytes, block: int) -> bool: ...

    def publish(self, block: int, key: bytes) -> None:
        """A prompt block just computed: a tier that others read (kv_share) stores it now, not
        on eviction; the others ignore it."""


def sequence_salt(salt: bytes, lora: str | None = None, rope_len: int = 0) -> bytes:
    """The seed of a sequence's hash chain: the engine's `salt` (its model), its LoRA adapter's name
    (an adapter changes every K/V, so no prefix crosses adapters) and the length it is rotated as
    (every K/V of a sequence rotated as a longer one, Sequence.rope_len, differs from its own)."""
    salt = salt if lora is None else salt + b"|lora:" + lora.encode()
    return salt + b"|rope:%d" % rope_len if rope_len else salt


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def block_hashes(token_ids: list[int], block_size: int, salt: bytes = b"", start: list[bytes] | None = None,
                 limit: int | None = None) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`: hash i covers tokens [0, (i+1)*block_size).

    `start` holds hashes already known for the first blocks (they are extended, not recomputed);
    `limit` caps the number of blocks hashed.
    """
    hashes = list(start or [])
    full = len(token_ids) // block_size
    if limit is not None:
        full = min(full, limit)
    parent = hashes[-1] if hashes else hashlib.sha256(b"qkv-prefix:" + salt).digest()
    for i in range(len(hashes), full):
        chunk = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent + chunk).digest()
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache, and how many were found (vLLM's counting)."""

    queries: int = 0
    hits: int = 0


class BlockManager:
    """Hands out fixed-size KV blocks; a sequence's `block_table` lists the blocks it holds in order."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 salt: bytes = b"", null_block: int | None = None, tier: BlockTier | None = None,
                 events: KVEventLog | None = None) -> None:
        """`events`: where the pool's prefix-cache changes are reported (model/engine/kv/events.py);
        None: not reported."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.null_block = num_blocks if null_block is None else null_block
        self.stats = PrefixCacheStats()
        self.tier = tier if enable_prefix_caching else None
        self.events = events if enable_prefix_caching else None
        self._free: deque[int] = deque(range(num_blocks))  # count 0, nothing cached in them
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block holding those computed tokens
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0 but cached; oldest first

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: the plain free ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose contents are findable by hash (in use or evictable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences, 0..1 (evictable cached blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have a slot."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` slots for its first `num_tokens` tokens; the caller checked `can_grow`."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        for _ in range(need):
            block = self._take_free()
            self._ref[block] = 1
            seq.block_table.append(block)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back `seq`'s trailing blocks beyond those its first `num_tokens` tokens need
        (blocks grown for rejected speculative tokens: never committed, never shared)."""
        keep = max(blocks_for(num_tokens, self.block_size), seq.num_committed_blocks)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.appendleft(block)

    def _take_free(self, keep: set[int] | frozenset[int] = frozenset()) -> int:
        """A free block, else the least recently used evictable one not in `keep` (saved to the
        tier first, if there is one)."""
        if self._free:
            return self._free.popleft()
        block = next(b for b in self._evictable if b not in keep)
        del self._evictable[block]
        if self.tier is not None and self._hash_of[block] is not None:
            self.tier.save(block, self._hash_of[block])
        self._uncache(block)
        return block

    def _uncache(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None and self._cached.get(h) == block:
            del self._cached[h]
            if self.events is not None:
                self.events.add(BlockRemoved((h,)))
        self._hash_of[block] = None

    def release_out_of_window(self, seq: Sequence, first_visible: int) -> None:
        """Give back `seq`'s leading blocks whose positions are all before `first_visible` (no
        query to come sees them); committed ones stay findable by hash until evicted."""
        end = min(max(0, first_visible) // self.block_size, len(seq.block_table))
        if end <= seq.num_released_blocks:
            return
        released = seq.block_table[seq.num_released_blocks:end]
        self._drop(released, seq)
        seq.block_table[seq.num_released_blocks:end] = [self.null_block] * len(released)
        seq.num_released_blocks = end

    def _drop(self, blocks: list[int], seq: Sequence) -> None:
        """Drop one hold on each of `blocks`, given head first; a block nobody holds is free (and,
        if cached, evictable, the later ones of a chain before the earlier)."""
        plain: list[int] = []
        for block in reversed(blocks):
            if self._ref[block] <= 0:
                raise RuntimeError(f"block {block} freed twice (sequence {seq.request_id})")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    plain.append(block)
        self._free.extend(reversed(plain))

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; a block nobody holds is free (and, if cached, evictable)."""
        self._drop(seq.block_table[seq.num_released_blocks:], seq)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        seq.num_released_blocks = 0

    # ---- prefix caching ---------------------------------------------------------------

    def hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of `seq`'s full blocks (computed once, extended as tokens are added)."""
        if len(seq.token_ids) // self.block_size > len(seq.block_hashes):
            seq.block_hashes = block_hashes(seq.hash_token_ids(), self.block_size,
                                            sequence_salt(self.salt, seq.lora, seq.rope_len), seq.block_hashes)
        return seq.block_hashes

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest run of `seq`'s leading full blocks, leaving at
        least its last token to compute (its logits are needed). Takes nothing from the pool's
        holders; with a tier, the run goes on with its blocks, loaded into evictable pool blocks."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self.hashes(seq)[:limit]
        found = self.cached_run(hashes)
        if self.tier is not None:
            found += self._from_tier(hashes[len(found):], set(found), hashes[len(found) - 1] if found else None)
        return found

    def cached_run(self, hashes: list[bytes]) -> list[int]:
        """The pool blocks holding the leading run of `hashes` (nothing is taken or revived)."""
        run = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            run.append(block)
        return run

    def cached_prefix(self, token_ids: list[int], lora: str | None = None) -> tuple[list[bytes], list[int]]:
        """The hashes of the full blocks of `token_ids` (run under `lora`) and the pool blocks
        holding their leading run; reads only (nothing is taken or revived)."""
        keys = block_hashes(token_ids, self.block_size, sequence_salt(self.salt, lora))
        return keys, self.cached_run(keys)

    def _from_tier(self, hashes: list[bytes], keep: set[int], parent: bytes | None = None) -> list[int]:
        """The run of `hashes` from the pool or the tier: the tier's blocks are copied into pool
        blocks, cached there as evictable (the caller takes them like any cached block). Stops at
        a block neither has or the tier cannot read back, or when only blocks of the run so far
        (`keep`) are left to reuse. `parent`: the hash before the first (for the events)."""
        run: list[int] = []
        kept_evictable = sum(1 for b in keep if b in self._evictable)
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                if len(self._free) + len(self._evictable) - kept_evictable == 0 or not self.tier.has(h):
                    break
                block = self._take_free(keep)
                if not self.tier.load(h, block):
                    self._free.appendleft(block)
                    break
                self._cached[h], self._hash_of[block] = block, h
                self._evictable[block] = None  # the most recently used: evicted last
                if self.events is not None:
                    self.events.add(BlockStored((h,), parent, (), self.block_size, None))
            parent = h
            if block in self._evictable:
                kept_evictable += 1
            keep.add(block)
            run.append(block)
        return run

    def first_uncached_hash(self, seq: Sequence, num_matched: int) -> bytes | None:
        """The hash of the first full block after the matched ones that `seq` would compute."""
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self.hashes(seq)
        return hashes[num_matched] if num_matched < min(limit, len(hashes)) else None

    def can_admit(self, seq: Sequence, matched: list[int], num_tokens: int) -> bool:
        """Whether `seq` can take `matched` and get slots for its first `num_tokens` tokens."""
        reviving = sum(1 for b in matched if self._ref[b] == 0)  # leave the evictable pool
        need = max(0, blocks_for(num_tokens, self.block_size) - len(matched))
        return need <= self.num_free - reviving

    def take(self, seq: Sequence, matched: list[int], count: bool = True) -> None:
        """Share `matched` (cached blocks, from `match`) with `seq`: they become its first blocks
        and their tokens count as computed. `count` adds the lookup to the hit statistics."""
        for block in matched:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
        seq.block_table = list(matched)
        seq.num_computed_tokens = len(matched) * self.block_size
        seq.num_committed_blocks = len(matched)
        if count and self.enable_prefix_caching:
            self.stats.queries += seq.num_prompt_tokens
            self.stats.hits += min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def commit(self, seq: Sequence) -> None:
        """Make `seq`'s full blocks whose K/V are now computed findable by hash. A block whose
        tokens another block already caches stays private (freed plainly later)."""
        if not self.enable_prefix_caching:
            return
        # num_computed_tokens counts accepted tokens only (a speculating sequence's rejected
        # proposals are rolled back first, Scheduler.verified), so no block holding the K/V of
        # a rejected token is ever hashed; the hashes come from token_ids, which never hold them.
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_committed_blocks:
            return
        hashes = self.hashes(seq)
        prompt_blocks = seq.num_prompt_tokens // self.block_size
        stored: list[int] = []
        for i in range(seq.num_committed_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if block != self.null_block and h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h
                stored.append(i)
                if self.tier is not None and i < prompt_blocks:
                    self.tier.publish(block, h)
        seq.num_committed_blocks = full
        if self.events is not None and stored:
            self._report_stored(seq, hashes, stored)

    def _report_stored(self, seq: Sequence, hashes: list[bytes], indices: list[int]) -> None:
        """One BlockStored per run of consecutive chain positions newly cached."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs = self.block_size
        for run in runs:
            first, last = run[0], run[-1]
            self.events.add(BlockStored(tuple(hashes[first:last + 1]), hashes[first - 1] if first else None,
                                        tuple(seq.token_ids[first * bs:(last + 1) * bs]), bs, seq.lora))
