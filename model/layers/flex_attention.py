"""Dot-product attention over the paged KV cache through FlexAttention
(`torch.nn.attention.flex_attention`), reading the block pool in place: the CUDA backend
behind the `DecodeKernel` / `PrefillKernel` seam (model/layers/attention.py).

Layout. One layer's pool, (num_blocks, block_size, Hkv, d), is viewed as a single key/value
sequence of num_blocks * block_size physical positions, (1, Hkv, N * bs, d), shared by every
batch row (FlexAttention broadcasts K/V over the batch when a block mask gives the batch).
Row b's `BlockMask` lists the physical blocks of its sequence, straight from its block table
(`kv_indices`), so the kernel visits those blocks only, in place, in table order. Inside them
a `mask_mod` maps a physical position back to its logical one through the inverse block
table (physical block -> logical block, -1 when the block is not the row's) and applies the
limits: the key is the row's, not after the query, and within the sliding window.

- decode: q (B, Hq, d), one query per sequence, at position context_lens[b] - 1.
- prefill: a chunk of L queries after a cached past, one sequence: query i at position
  context_len - L + i, causal.

The block mask is built once per step and shared by every layer (`new_step` clears it; the
runner calls it when it prepares a step), from device tensors only, with no host sync, so a
decode step that calls it can be captured in a CUDA graph.

On CUDA the call is compiled (`torch.compile`, one kernel per shape: the batch and a prefill
chunk's length are padded to a power of two, the block lists to the whole pool; the KV block of
the mask is the cache's block, which the Triton kernels need to be a multiple of 16). On the CPU it runs FlexAttention's unfused reference (scores over the whole
pool, materialised): correct, used by the tests to check this backend against the gather
path, far too slow to serve; the CPU's serving backend is the fused C++ kernel.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

logger = logging.getLogger(__name__)

# One query block covers every query of a decode row or of a (short) prefill chunk; a multiple
# of the Triton decode kernel's BLOCK_M (next power of two of queries x query heads per KV head).
Q_BLOCK = 128
# Compiled shapes per process: decode batches (powers of two) x prefill lengths x windows.
RECOMPILE_LIMIT = 64

_compiled: dict[str, object] = {}


def flex_supported(device: torch.device, block_size: int) -> bool:
    """Whether the compiled kernels can run on `device` with this cache block size."""
    return device.type == "cuda" and block_size % 16 == 0


def _compiled_flex():
    if "fn" not in _compiled:
        import torch._dynamo

        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # before 2.6
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _compiled["fn"] = torch.compile(flex_attention, dynamic=False)
    return _compiled["fn"]


@dataclass
class _Plan:
    """One step's block mask for one set of block tables (kept with the tensors it was built from)."""

    key: tuple
    mask: BlockMask


class FlexPagedAttention:
    """FlexAttention decode and prefill kernels over one engine's paged cache.

    `compiled`: run the compiled kernel (default on CUDA) or the unfused reference (CPU)."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str,
                 compiled: bool | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.compiled = self.device.type == "cuda" if compiled is None else compiled
        self._plans: list[_Plan] = []

    def new_step(self) -> None:
        """Forget the block masks of the last step (their block tables are gone or rewritten)."""
        self._plans = []

    # ---- the seam -------------------------------------------------------------------------

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
        """q (B, Hq, d), block_tables (B, W), context_lens (B,) -> (B, Hq, d) (a `DecodeKernel`)."""
        b = q.shape[0]
        # The plan is keyed by the step's own tensors: padded copies are new tensors each layer.
        key = (block_tables, context_lens, 1, window)
        rows = _next_power_of_two(b) if self.compiled else b  # one compiled kernel per power of two
        if rows != b:
            q = torch.cat([q, q.new_zeros(rows - b, *q.shape[1:])])
            block_tables = torch.cat([block_tables, block_tables.new_zeros(rows - b, block_tables.shape[1])])
            context_lens = torch.cat([context_lens, context_lens.new_zeros(rows - b)])
        mask = self._mask(key, block_tables, context_lens, 1, window)
        out = self._attend(q.unsqueeze(2), k_cache, v_cache, mask, scale)  # (rows, Hq, 1, d)
        return out[:b, :, 0]

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                context_len: int, scale: float, window: int | None = None) -> torch.Tensor:
        """A chunk of L queries ending a context of `context_len` positions, causal:
        q (L, Hq, d), block_table (W,) -> (L, Hq, d) (a `PrefillKernel`)."""
        length = q.shape[0]
        padded = _next_power_of_two(length) if self.compiled else length
        # Padding queries sit after the chunk, at positions >= context_len: they see every real
        # key and are dropped. The row's blocks stay those of its real context: counting the
        # padding as context would list blocks past the table, whose padding entries point at
        # physical block 0, which the kernel would then visit twice when the row owns it.
        lens = torch.full((1,), context_len, dtype=torch.long, device=q.device)
        starts = torch.full((1,), context_len - length, dtype=torch.long, device=q.device)
        if padded != length:
            q = torch.cat([q, q.new_zeros(padded - length, *q.shape[1:])])
        mask = self._mask((block_table, context_len, padded, window), block_table[None], lens, padded, window,
                          starts)
        out = self._attend(q.transpose(0, 1)[None], k_cache, v_cache, mask, scale)  # (1, Hq, L', d)
        return out[0, :, :length].transpose(0, 1)

    # ---- internals ------------------------------------------------------------------------

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: BlockMask,
                scale: float) -> torch.Tensor:
        """q (B, Hq, Lq, d) over the whole pool seen as one sequence -> (B, Hq, Lq, d) in q's dtype."""
        n, bs, hkv, d = k_cache.shape
        k = k_cache.view(1, n * bs, hkv, d).transpose(1, 2)  # (1, Hkv, N * bs, d), a view of the pool
        v = v_cache.view(1, n * bs, hkv, d).transpose(1, 2)
        fn = _compiled_flex() if self.compiled else flex_attention
        options = {"BLOCK_N": math.gcd(bs, 64)} if self.compiled and self.device.type == "cuda" else None
        out = fn(q.to(k_cache.dtype), k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != hkv,
                 kernel_options=options)
        return out.to(q.dtype)

    def _mask(self, key: tuple, block_tables: torch.Tensor, context_lens: torch.Tensor, q_len: int,
              window: int | None, starts: torch.Tensor | None = None) -> BlockMask:
        """The block mask of rows with `q_len` queries over each row's context (`build_block_mask`),
        built once per `key` (its tensors compared by identity, the rest by value) and shared by
        the layers."""
        for plan in self._plans:
            if all(a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(plan.key, key)):
                return plan.mask
        mask = build_block_mask(block_tables, context_lens, q_len, window, self.num_blocks, self.block_size,
                                full_width=self.compiled, starts=starts)
        self._plans.append(_Plan(key, mask))
        return mask


def build_block_mask(block_tables: torch.Tensor, context_lens: torch.Tensor, q_len: int, window: int | None,
                     num_blocks: int, block_size: int, full_width: bool = False,
                     starts: torch.Tensor | None = None) -> BlockMask:
    """BlockMask over the physical pool for B rows: row b's keys are the context_lens[b]
    positions held in block_tables[b] (B, W); its `q_len` queries sit at positions starts[b] ..
    starts[b] + q_len - 1 (default: the context's last q_len positions; queries past the
    context, a compiled chunk's padding, see all of it). Each row lists only the blocks of its
    context: ceil(context_lens[b] / block_size) <= W.

    Device ops only (no host sync). `full_width` pads the block lists to every block of the
    pool: one shape whatever the tables' width, so the compiled kernel is not recompiled as
    contexts grow (and the CPU's compiled kernel wants it)."""
    b, w = block_tables.shape
    bs = block_size
    used = (context_lens + bs - 1) // bs  # (B,) blocks that hold the row's context
    j = torch.arange(w, device=block_tables.device)
    # Inverse block tables (B, N): logical block of each physical block, -1 where not the row's.
    # Entries past a row's used blocks (padding) land in a dump column, dropped after.
    cols = torch.where(j[None, :] < used[:, None], block_tables, num_blocks)
    inverse = torch.full((b, num_blocks + 1), -1, dtype=torch.int32, device=block_tables.device)
    inverse.scatter_(1, cols, j.to(torch.int32)[None, :].expand(b, w).contiguous())
    inverse = inverse[:, :num_blocks]
    if starts is None:
        starts = context_lens - q_len
    starts = starts.to(torch.int32)  # (B,) position of each row's first query

    def mask_mod(bi, hi, q_idx, kv_idx):
        logical = inverse[bi, kv_idx // bs]
        pos = logical * bs + kv_idx % bs
        q_pos = starts[bi] + q_idx
        seen = (logical >= 0) & (pos <= q_pos)
        if window is not None:
            seen = seen & (pos > q_pos - window)
        return seen

    indices = block_tables.to(torch.int32)
    if full_width and w < num_blocks:
        indices = torch.cat([indices, indices.new_zeros(b, num_blocks - w)], dim=1)
    kv_num_blocks = used.to(torch.int32).view(b, 1, 1)
    return BlockMask.from_kv_blocks(kv_num_blocks, indices.view(b, 1, 1, -1), BLOCK_SIZE=(Q_BLOCK, bs),
                                    mask_mod=mask_mod, seq_lengths=(q_len, num_blocks * bs),
                                    compute_q_blocks=False)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
