"""Accounting of the paged KV pool: which blocks are free, which sequence holds which. No torch."""

from __future__ import annotations

from collections import deque

from model.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out fixed-size KV blocks; a sequence's `block_table` lists the blocks it holds in order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so that its first `num_tokens` tokens have a slot."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` slots for its first `num_tokens` tokens; the caller checked `can_grow`."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self._free)} free")
        seq.block_table.extend(self._free.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` to the pool."""
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
