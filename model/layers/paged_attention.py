"""Dot-product attention over the paged KV cache, two ways behind one set of functions.

- `fused`: a C++ kernel (`csrc/paged_attention.cpp`) that reads each sequence's keys and values
  where they lie in the block pool, with no per-layer gather copy; built with PyTorch's extension
  mechanism on first use (or by `make install`) into a per-user cache directory.
- `gather`: the reference: copy each sequence's blocks into a contiguous workspace, then SDPA.
  Tests compare the two; it is also the path when the kernel cannot be built (a warning is
  logged once) and on devices other than the CPU.

Shapes: the cache is (num_blocks, block_size, Hkv, d); queries carry Hq = G * Hkv heads, query
head i reads KV head i // G (grouped-query attention; G = 1 is plain multi-head attention).

`window` (every function's last argument; None: the whole context): sliding-window attention as
HF transformers masks it: the query at position i sees key j when i - window < j <= i, i.e. at
most `window` positions, itself included.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from model.layers.cpp_kernel import CppKernel, register_fake_once

logger = logging.getLogger(__name__)



def _register_fakes() -> None:
    """The op's output for torch.compile's tracing: q's shape, float32."""
    register_fake_once("qkv_paged::paged_attention", lambda q, k_cache, v_cache, block_tables, query_seq, num_keys,
                       scale, window: q.new_empty(q.shape, dtype=torch.float32))


_KERNEL = CppKernel("qkv_paged_attention", Path(__file__).with_name("csrc") / "paged_attention.cpp",
                    namespace="qkv_paged", op="paged_attention", directory_prefix="paged_attention",
                    fallback="fused paged attention unavailable, using the gather path", log=logger,
                    on_load=_register_fakes)
_state = _KERNEL.state  # "loaded" -> whether the kernel is usable (tests reset it)
build_directory = _KERNEL.build_directory


def kernel_available() -> bool:
    """Build (first call, about a minute) or load the fused kernel; False, with one warning
    logged, when it cannot be built (no compiler, no ninja, ...)."""
    return _KERNEL.available()


def use_fused(device: torch.device) -> bool:
    """Whether attention on `device` goes through the fused kernel."""
    return device.type == "cpu" and kernel_available()


# ---- fused ---------------------------------------------------------------------------------

def fused_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_seq: torch.Tensor, num_keys: torch.Tensor, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q (T, Hq, d); query t attends to the first num_keys[t] positions (the last `window` of
    them with a window) of the sequence whose block table is block_tables[query_seq[t]]
    -> (T, Hq, d) in q's dtype."""
    if not kernel_available():
        raise RuntimeError("the fused paged-attention kernel could not be built; use the gather path")
    out = torch.ops.qkv_paged.paged_attention(q.float(), k_cache, v_cache, block_tables.long(),
                                              query_seq.long(), num_keys.long(), float(scale), int(window or 0))
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """One query per sequence: q (B, Hq, d), block_tables (B, W), context_lens (B,) -> (B, Hq, d)."""
    seqs = torch.arange(q.shape[0], device=q.device)
    return fused_attention(q, k_cache, v_cache, block_tables, seqs, context_lens, scale, window)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """A chunk of L queries at the end of a context of `context_len` cached positions (the chunk
    included), causal: q (L, Hq, d), block_table (W,) -> (L, Hq, d)."""
    length = q.shape[0]
    num_keys = torch.arange(context_len - length + 1, context_len + 1, device=q.device)
    seqs = torch.zeros(length, dtype=torch.long, device=q.device)
    return fused_attention(q, k_cache, v_cache, block_table[None], seqs, num_keys, scale, window)


# ---- gather (reference) --------------------------------------------------------------------

def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of sequences' K/V: block_tables (B, W) -> two (B, W * block_size, Hkv, d)."""
    b, w = block_tables.shape
    shape = (b, w * k_cache.shape[1], *k_cache.shape[2:])
    flat = block_tables.reshape(-1)
    return (torch.index_select(k_cache, 0, flat).view(shape), torch.index_select(v_cache, 0, flat).view(shape))


def visible_keys(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """(..., num_keys) bool: key j is visible from a query at `query_pos` (any shape) when
    j <= query_pos and, with a window, j > query_pos - window."""
    keys = torch.arange(num_keys, device=query_pos.device)
    pos = query_pos[..., None]
    mask = keys <= pos
    return mask if window is None else mask & (keys > pos - window)


def gather_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """Reference for `paged_decode_attention`: gather, mask past each context (and before its
    window), SDPA."""
    k, v = gather_kv(k_cache, v_cache, block_tables)  # (B, S, Hkv, d)
    s = int(context_lens.max())
    k, v = k[:, :s].transpose(1, 2).to(q.dtype), v[:, :s].transpose(1, 2).to(q.dtype)  # (B, Hkv, S, d)
    mask = visible_keys(context_lens - 1, s, window)[:, None, None, :]  # (B, 1, 1, S)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (B, Hq, 1, d)
    return out.squeeze(2)


def gather_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, context_len: int, scale: float,
                             window: int | None = None) -> torch.Tensor:
    """Reference for `paged_prefill_attention`."""
    length = q.shape[0]
    k, v = gather_kv(k_cache, v_cache, block_table[None])  # (1, S, Hkv, d)
    k = k[:, :context_len].transpose(1, 2).to(q.dtype)  # (1, Hkv, S, d)
    v = v[:, :context_len].transpose(1, 2).to(q.dtype)
    mask = visible_keys(torch.arange(context_len - length, context_len, device=q.device), context_len, window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (1, Hq, L, d)
    return out[0].transpose(0, 1)
