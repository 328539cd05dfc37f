"""Multi-head attention over the paged KV cache, with two scoring functions behind one interface.

- `dot`: softmax(Q K^T / sqrt(d_k)) V, all heads at once through torch SDPA.
- `additive` (Bahdanau): score(q, k) = v^T tanh(W_q q + W_k k), per head, with its own
  parameters. The cache stores the projected keys W_k k, so the past is never recomputed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.kv_cache import AttnMetadata, KVCache

# Upper bound on the elements of the (B, H, Lq, S, d) tensor additive attention builds at once.
ADDITIVE_CHUNK_ELEMS = 1 << 24


class DotScore(nn.Module):
    """Scaled dot-product scoring; holds no parameters."""

    def project_keys(self, k: torch.Tensor) -> torch.Tensor:
        return k

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """q (B, H, Lq, d), k/v (B, H, S, d), mask bool broadcastable to (B, H, Lq, S) -> (B, H, Lq, d)."""
        # SDPA scales by 1/sqrt(d_k) itself.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)


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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               causal: bool = False) -> torch.Tensor:
        """Same shapes as `DotScore.attend`; `k` holds projected keys. Chunked over queries
        so that a long prefill never builds the whole (Lq, S, d) tensor at once."""
        b, h, lq, d = q.shape
        s = k.shape[2]
        if causal and mask is None:
            mask = torch.ones(lq, s, dtype=torch.bool, device=q.device).tril(s - lq)
        qp = torch.einsum("bhld,hde->bhle", q, self.w_q)  # (B, H, Lq, d)
        step = max(1, ADDITIVE_CHUNK_ELEMS // max(1, b * h * s * d))
        outs = []
        for i in range(0, lq, step):
            feats = torch.tanh(qp[:, :, i:i + step, None, :] + k[:, :, None, :, :])  # (B, H, c, S, d)
            scores = torch.einsum("bhcsd,hd->bhcs", feats, self.v)  # (B, H, c, S)
            if mask is not None:
                m = mask[..., i:i + step, :] if mask.shape[-2] > 1 else mask
                scores = scores.masked_fill(~m, float("-inf"))
            outs.append(torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v)  # (B, H, c, d)
        return torch.cat(outs, dim=2)


class MultiHeadAttention(nn.Module):
    """Q/K/V projections, h heads of d_k = d_v = d_model / h, a scoring function, output projection."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.score: DotScore | AdditiveScore = (
            AdditiveScore(cfg.n_heads, cfg.d_head) if cfg.attention == "additive" else DotScore()
        )

    def forward(self, x: torch.Tensor, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        """x (T, d_model) -> (T, d_model); writes this step's K/V into `cache` first."""
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.n_heads, self.d_head).unbind(1)  # each (T, H, d)
        cache.update(self.layer, meta.slot_mapping, self.score.project_keys(k), v)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], meta, cache)
        for chunk in meta.prefills:
            sl = slice(chunk.start, chunk.start + chunk.length)
            out[sl] = self._prefill(q[sl], chunk.block_table, chunk.context_len, cache)
        return self.out(out.view(t, -1))

    def _decode(self, q: torch.Tensor, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        """One query per sequence: q (B, H, d) against each sequence's cached past -> (B, H, d)."""
        assert meta.decode_block_tables is not None
        k, v = cache.gather(self.layer, meta.decode_block_tables)  # (B, S, H, d)
        s = meta.decode_max_context
        k, v = k[:, :s].transpose(1, 2), v[:, :s].transpose(1, 2)  # (B, H, S, d)
        mask = meta.decode_mask(cache.block_size)[..., :s]  # (B, 1, 1, S)
        return self.score.attend(q.unsqueeze(2), k, v, mask).squeeze(2)

    def _prefill(self, q: torch.Tensor, block_table: torch.Tensor, context_len: int,
                 cache: KVCache) -> torch.Tensor:
        """A chunk of L queries at the end of a context of `context_len` positions -> (L, H, d)."""
        length = q.shape[0]
        k, v = cache.gather(self.layer, block_table[None])  # (1, S_blocks, H, d)
        k, v = k[:, :context_len].transpose(1, 2), v[:, :context_len].transpose(1, 2)  # (1, H, S, d)
        start = context_len - length
        mask = None
        if start:
            # Query i sits at position start + i and sees keys 0 .. start + i.
            mask = torch.ones(length, context_len, dtype=torch.bool, device=q.device).tril(start)
        out = self.score.attend(q.transpose(0, 1)[None], k, v, mask, causal=True)  # (1, H, L, d)
        return out[0].transpose(0, 1)
