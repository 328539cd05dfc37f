"""Attention over the paged KV cache, with two scoring functions behind one interface.

- `dot`: softmax(Q K^T / sqrt(d_k)) V, all heads at once through torch SDPA; grouped-query
  attention (fewer K/V heads than query heads) included.
- `additive` (Bahdanau): score(q, k) = v^T tanh(W_q q + W_k k), per head, with its own
  parameters. The cache stores the projected keys W_k k, so the past is never recomputed.

`PagedAttention` is the seam every architecture calls: it writes this step's K/V into the
cache and attends each query over its sequence's cached past. Decoding runs through the
reference gather path, or through a fused kernel (`DecodeKernel`, model/layers/paged_attention.py)
that the runner puts in the step's metadata. A prefill chunk with nothing cached before it
attends to its own fresh K/V (no cache read); a short chunk after a cached past goes through
the fused kernel when there is one (`PrefillKernel`), a longer one through the gather path,
where SDPA's blocked matmuls beat a per-query kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers.kv_cache import AttnMetadata, KVCache

# A fused decode kernel: (q (B, Hq, d), k_cache, v_cache (num_blocks, block_size, Hkv, d),
# block_tables (B, W) long, context_lens (B,) long, scale) -> (B, Hq, d).
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# A fused prefill kernel: (q (L, Hq, d), k_cache, v_cache, block_table (W,) long, context_len,
# scale) -> (L, Hq, d), query i at position context_len - L + i, causal.
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
# Chunks of at most this many queries after a cached past use the prefill kernel (measured on
# a 2-core CPU: the kernel wins at 16 queries over 1,024 cached positions, loses at 64 over 512).
FUSED_PREFILL_MAX_QUERIES = 16

# Upper bound on the elements of the (B, H, Lq, S, d) tensor additive attention builds at once.
ADDITIVE_CHUNK_ELEMS = 1 << 22


class DotScore(nn.Module):
    """Scaled dot-product scoring; holds no parameters.

    `scaled=False` drops the 1/sqrt(d_k) (the paper's ablation, for experiments only)."""

    def __init__(self, d_head: int, scaled: bool = True) -> None:
        super().__init__()
        self.scale = d_head**-0.5 if scaled else 1.0

    def project_keys(self, k: torch.Tensor) -> torch.Tensor:
        return k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               causal_offset: int | None = None) -> torch.Tensor:
        """q (B, H, Lq, d), k/v (B, H, S, d) -> (B, H, Lq, d).

        `mask`: bool, broadcastable to (B, H, Lq, S), True where a key may be seen.
        `causal_offset`: query i sits at position causal_offset + i and sees keys 0 .. that position.
        K/V may have fewer heads than q (grouped-query attention): query head h reads K/V head
        h // (Hq / Hkv).
        """
        gqa = q.shape[1] != k.shape[1]
        if causal_offset is not None:
            if causal_offset == 0 and mask is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
            mask = causal_mask(q.shape[2], k.shape[2], causal_offset, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=self.scale)


def causal_mask(lq: int, s: int, offset: int, device: torch.device) -> torch.Tensor:
    """(Lq, S) bool: query i sees keys 0 .. offset + i."""
    return torch.ones(lq, s, dtype=torch.bool, device=device).tril(offset)


class AdditiveScore(nn.Module):
    """Bahdanau scoring per head: e_ij = v_h^T tanh(W_q,h q_i + W_k,h k_j)."""

    def __init__(self, n_heads: int, d_head: int) -> None:
        super().__init__()
        self.w_q = nn.Parameter(torch.empty(n_heads, d_head, d_head))
        self.w_k = nn.Parameter(torch.empty(n_heads, d_head, d_head))
        self.v = nn.Parameter(torch.empty(n_heads, d_head))

    def project_keys(self, k: torch.Tensor) -> torch.Tensor:
        """(T, H, d) keys -> (T, H, d) projected keys W_k k, the form the cache stores."""
        return torch.einsum("thd,hde->the", k, self.w_k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               causal_offset: int | None = None) -> torch.Tensor:
        """Same contract as `DotScore.attend`; `k` holds projected keys. Chunked over queries
        so that a long prefill never builds the whole (Lq, S, d) tensor at once; with a
        causal offset each chunk only scores the keys it can see."""
        b, h, lq, d = q.shape
        s = k.shape[2]
        qp = torch.einsum("bhld,hde->bhle", q, self.w_q)  # (B, H, Lq, d)
        step = max(1, ADDITIVE_CHUNK_ELEMS // max(1, b * h * s * d))
        outs = []
        for i in range(0, lq, step):
            c = min(step, lq - i)
            end = s if causal_offset is None else min(s, causal_offset + i + c)  # keys this chunk sees
            feats = torch.tanh(qp[:, :, i:i + c, None, :] + k[:, :, None, :end, :])  # (B, H, c, S', d)
            scores = torch.einsum("bhcsd,hd->bhcs", feats, self.v)  # (B, H, c, S')
            if causal_offset is not None:
                scores = scores.masked_fill(~causal_mask(c, end, causal_offset + i, q.device), float("-inf"))
            if mask is not None:
                m = mask[..., i:i + c, :end] if mask.shape[-2] > 1 else mask[..., :end]
                scores = scores.masked_fill(~m, float("-inf"))
            outs.append(torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v[:, :, :end])  # (B, H, c, d)
        return torch.cat(outs, dim=2)


class PagedAttention:
    """This step's queries over the paged cache of one layer with a scoring function, `dot`
    or `additive` (the latter without grouped-query attention). Holds no parameters: the
    layer that owns the scoring module (and its weights) passes it in."""

    def __init__(self, layer: int, d_head: int, score: DotScore | AdditiveScore) -> None:
        self.layer = layer
        self.scale = score.scale if isinstance(score, DotScore) else d_head**-0.5
        self.score = score

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata,
                cache: KVCache) -> torch.Tensor:
        """q (T, Hq, d), k/v (T, Hkv, d) -> (T, Hq, d); writes this step's K/V into `cache` first."""
        k = self.score.project_keys(k)
        cache.update(self.layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], meta, cache)
        for chunk in meta.prefills:
            sl = slice(chunk.start, chunk.start + chunk.length)
            if chunk.context_len == chunk.length:  # nothing cached before it: its own K/V are the context
                out[sl] = self._attend_chunk(q[sl], k[sl], v[sl], start=0)
            else:
                out[sl] = self._prefill(q[sl], chunk.block_table, chunk.context_len, cache, meta)
        if meta.capture is not None:  # an attention request's recompute (model/inspect/attention_maps.py)
            meta.capture.record(self, q, meta, cache)
        return out

    def _decode(self, q: torch.Tensor, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        """One query per sequence: q (B, Hq, d) against each sequence's cached past -> (B, Hq, d)."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        if meta.decode_kernel is not None and isinstance(self.score, DotScore):
            return meta.decode_kernel(q, cache.keys[self.layer], cache.values[self.layer],
                                      meta.decode_block_tables, meta.decode_context_lens, self.scale)
        k, v = cache.gather(self.layer, meta.decode_block_tables)  # (B, S_blocks, Hkv, d)
        s = meta.decode_max_context
        k, v = k[:, :s].transpose(1, 2).to(q.dtype), v[:, :s].transpose(1, 2).to(q.dtype)  # (B, Hkv, S, d)
        mask = meta.decode_mask  # (B, 1, 1, S)
        return self.score.attend(q.unsqueeze(2), k, v, mask=mask).squeeze(2)

    def _prefill(self, q: torch.Tensor, block_table: torch.Tensor, context_len: int, cache: KVCache,
                 meta: AttnMetadata) -> torch.Tensor:
        """A chunk of L queries at the end of a context of `context_len` positions -> (L, Hq, d)."""
        length = q.shape[0]
        if (meta.prefill_kernel is not None and isinstance(self.score, DotScore)
                and length <= FUSED_PREFILL_MAX_QUERIES):
            return meta.prefill_kernel(q, cache.keys[self.layer], cache.values[self.layer], block_table,
                                       context_len, self.scale)
        k, v = cache.gather(self.layer, block_table[None])  # (1, S_blocks, Hkv, d)
        return self._attend_chunk(q, k[0, :context_len], v[0, :context_len], start=context_len - length)

    def _attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q (L, Hq, d) at positions start .. start + L - 1 over k/v (S, Hkv, d), causal -> (L, Hq, d)."""
        q_, k_, v_ = (z.transpose(0, 1)[None].to(q.dtype) for z in (q, k, v))  # (1, H, L or S, d)
        return self.score.attend(q_, k_, v_, causal_offset=start)[0].transpose(0, 1)


class MultiHeadAttention(nn.Module):
    """The paper's (and GPT-2's) attention: one fused Q/K/V projection, h heads of
    d_k = d_v = d_model / h, a scoring function over the paged cache, output projection."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.score: DotScore | AdditiveScore = (
            AdditiveScore(cfg.n_heads, cfg.d_head) if cfg.attention == "additive"
            else DotScore(cfg.d_head, cfg.scale_scores)
        )
        self.attn = PagedAttention(layer, cfg.d_head, self.score)

    def forward(self, x: torch.Tensor, meta: AttnMetadata | None, cache: KVCache | None) -> torch.Tensor:
        """x (T, d_model) -> (T, d_model) over the paged cache.

        Without a cache (training), x is (B, T, d_model): causal attention within each row."""
        if cache is None:
            return self._dense_causal(x)
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.n_heads, self.d_head).unbind(1)  # each (T, H, d)
        return self.out(self.attn(q, k, v, meta, cache).view(t, -1))

    def _dense_causal(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, T, d_model), every position seeing itself and the past."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.d_head).unbind(2)  # each (B, T, H, d)
        k = self.score.project_keys(k.reshape(b * t, self.n_heads, self.d_head)).view(b, t, self.n_heads, -1)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, d)
        out = self.score.attend(q, k, v, causal_offset=0)  # (B, H, T, d)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))
