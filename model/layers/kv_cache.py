"""The paged KV cache: one pool of fixed-size blocks per layer, and the per-step metadata
that tells attention where each sequence's keys and values live.

A sequence's token at position p lives in block `block_table[p // block_size]`, row
`p % block_size`. Memory follows the tokens actually held, not the maximum length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk in this step: `length` query tokens at `start` in the
    flattened batch, attending to `context_len` cached positions (its own chunk included)."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks_of_seq,) long


@dataclass
class AttnMetadata:
    """Everything attention needs for one step; built by the runner, passed explicitly.

    The flattened batch holds the decode tokens first (`num_decode` of them, one per
    sequence), then each prefill chunk contiguously.
    """

    slot_mapping: torch.Tensor  # (T,) long: flat cache row of each token's K/V
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # (B_d, max_blocks) long, padded with 0
    decode_context_lens: torch.Tensor | None = None  # (B_d,) long, new token included
    decode_max_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # A fused paged decode-attention kernel (see model.attention.DecodeKernel); None: the
    # reference gather path.
    decode_kernel: Callable[..., torch.Tensor] | None = None
    # A fused prefill kernel for short chunks after a cached past (model.attention.PrefillKernel).
    prefill_kernel: Callable[..., torch.Tensor] | None = None
    # An attention-weights capture (model.inspect.attention_maps.AttentionCapture), set only for the
    # explicit recompute of an attention request; None in every serving step.
    capture: Any = None
    # Which rows use which LoRA adapter slot (model.layers.lora.LoraBatch); None: the base model only.
    lora: Any = None
    # (T,) long: dynamic NTK / LongRoPE rows rotated as in a sequence of at least that many tokens
    # (prefill rows of a sequence longer than the original context; 0: by position); None: all by position.
    rope_len: torch.Tensor | None = None
    # Vision-language models: image embeddings that replace the token embeddings of their placeholder
    # rows, as (rows (N,) long, embeddings (N, d_model)); None: every row embeds its token.
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE (Qwen2-VL): (3, T) long (temporal, height, width) positions of every row; None: each
    # row's position on all three axes.
    mrope_positions: torch.Tensor | None = None
    # decode_window_mask's masks, one per sliding-window size in use this step.
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """(B_d, 1, 1, decode_max_context) bool: True where a cached position is valid.
        Built once per step and shared by every layer."""
        assert self.decode_context_lens is not None
        pos = torch.arange(self.decode_max_context, device=self.decode_context_lens.device)
        return (pos[None, :] < self.decode_context_lens[:, None])[:, None, None, :]

    def decode_window_mask(self, window: int | None) -> torch.Tensor:
        """`decode_mask` for a layer with a sliding window: only each context's last `window`
        positions are valid (HF: key j is seen from position i when i - window < j <= i).
        Built once per step and window size; None: `decode_mask` itself."""
        if window is None:
            return self.decode_mask
        if window not in self._window_masks:
            assert self.decode_context_lens is not None
            pos = torch.arange(self.decode_max_context, device=self.decode_context_lens.device)
            lens = self.decode_context_lens[:, None]
            self._window_masks[window] = ((pos[None, :] < lens) & (pos[None, :] >= lens - window))[:, None, None, :]
        return self._window_masks[window]


class KVCache:
    """Block pools for every layer, allocated once, outside `forward`.

    `keys[layer]` and `values[layer]`: (num_blocks, block_size, n_kv_heads, d_head), so a
    grouped-query model stores only its K/V heads. For additive
    attention the "keys" are the projected keys W_k k, which is what decoding needs.
    """

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, d_head: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_blocks, block_size, n_kv_heads, d_head)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        # Reused gather destinations (rows = blocks): a fresh multi-MB tensor per layer and step
        # costs a page fault per 4 KiB on the CPU, more than the copy itself.
        self._work = (torch.empty(0, block_size * n_kv_heads * d_head, dtype=dtype, device=device),) * 2

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, n_kv_heads: int, d_head: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * block_size * n_kv_heads * d_head * elem

    def update(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's K/V, (T, n_kv_heads, d_head), into their slots, in the cache's dtype."""
        kc, vc = self.keys[layer], self.values[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slot_mapping, v.to(vc.dtype))

    @property
    def workspace_blocks(self) -> int:
        """Blocks the gather workspace holds now (per K and V)."""
        return self._work[0].shape[0]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K/V of sequences: block_tables (B, nb) -> two (B, nb * block_size, H, d).

        The results are views of a workspace that the next `gather` overwrites."""
        kc, vc = self.keys[layer], self.values[layer]
        b, nb = block_tables.shape
        flat = block_tables.reshape(-1)
        if self._work[0].shape[0] < flat.numel():
            rows = max(flat.numel(), 2 * self._work[0].shape[0])
            self._work = tuple(torch.empty(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in self._work)
        wk, wv = (w[: flat.numel()] for w in self._work)
        # index_select over 2-D views copies whole blocks as rows, far faster than fancy indexing.
        torch.index_select(kc.view(kc.shape[0], -1), 0, flat, out=wk)
        torch.index_select(vc.view(vc.shape[0], -1), 0, flat, out=wv)
        shape = (b, nb * self.block_size, *kc.shape[2:])
        return wk.view(shape), wv.view(shape)
