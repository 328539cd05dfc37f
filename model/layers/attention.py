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

Per-layer options of dot-product attention (`PagedAttention(..., window=, softcap=)`, the scale
through `DotScore(scale=)`, sinks passed with each call):
- `window`: sliding-window attention, HF's definition: the query at position i sees key j when
  i - window < j <= i. Every path honours it (fused kernels take it as their last argument).
- `softcap` (Gemma 2): scores become tanh(s / cap) * cap before the softmax.
- `sinks` (gpt-oss): one learned logit per query head that joins each softmax's denominator
  (and takes its share of the probability mass, then is dropped).
Layers with a softcap or sinks run the gather path's explicit-softmax reference (`eager_attention`):
the fused kernels and SDPA compute a plain softmax, so they are skipped for those layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers.kv_cache import AttnMetadata, KVCache
from model.layers.linear.dense import Linear

# A fused decode kernel: (q (B, Hq, d), k_cache, v_cache (num_blocks, block_size, Hkv, d),
# block_tables (B, W) long, context_lens (B,) long, scale, window: int | None) -> (B, Hq, d); query
# b sits at position context_lens[b] - 1 and sees the last `window` positions (all: None).
# `window` is always passed (positionally, the last argument).
DecodeKernel = Callable[..., torch.Tensor]
# A fused prefill kernel: (q (L, Hq, d), k_cache, v_cache, block_table (W,) long, context_len,
# scale, window: int | None) -> (L, Hq, d), query i at position context_len - L + i, causal (and
# within the window).
PrefillKernel = Callable[..., torch.Tensor]
# Chunks of at most this many queries after a cached past use the prefill kernel (measured on
# a 2-core CPU: the kernel wins at 16 queries over 1,024 cached positions, loses at 64 over 512).
FUSED_PREFILL_MAX_QUERIES = 16

# Upper bound on the elements of the (B, H, Lq, S, d) tensor additive attention builds at once.
ADDITIVE_CHUNK_ELEMS = 1 << 22


class DotScore(nn.Module):
    """Scaled dot-product scoring; holds no parameters.

    `scaled=False` drops the 1/sqrt(d_k) (the paper's ablation, for experiments only); `scale`
    overrides it (Gemma: query_pre_attn_scalar ** -0.5)."""

    def __init__(self, d_head: int, scaled: bool = True, scale: float | None = None) -> None:
        super().__init__()
        self.scale = scale if scale is not None else d_head**-0.5 if scaled else 1.0

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


def band_mask(lq: int, s: int, q_start: int, k_start: int, window: int | None,
              device: torch.device) -> torch.Tensor:
    """(Lq, S) bool: query i (position q_start + i) sees key j (position k_start + j) when the key
    is not after it and, with a window, within the last `window` positions."""
    qpos = torch.arange(q_start, q_start + lq, device=device)[:, None]
    kpos = torch.arange(k_start, k_start + s, device=device)[None, :]
    mask = kpos <= qpos
    return mask if window is None else mask & (kpos > qpos - window)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Explicit-softmax attention, for scores SDPA cannot express: q (B, Hq, Lq, d), k/v
    (B, Hkv, S, d), mask bool broadcastable to (B, Hq, Lq, S) -> (B, Hq, Lq, d).

    Follows HF's eager attention of Gemma 2 (softcap, softmax in float32) and gpt-oss (sinks
    concatenated as a last column, max subtracted, softmax in the scores' dtype, column dropped)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: query head h reads K/V head h // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, Hq, Lq, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        b, h, lq, _ = scores.shape
        logits = torch.cat([scores, sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, lq, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return probs @ v


class PagedAttention:
    """This step's queries over the paged cache of one layer with a scoring function, `dot`
    or `additive` (the latter without grouped-query attention). Holds no parameters: the
    layer that owns the scoring module (and its weights, and any sinks) passes it in.

    `window`: sliding-window attention over at most that many positions (None: the whole
    context); `softcap`: Gemma 2's attention logit soft-capping. Both for `dot` only."""

    def __init__(self, layer: int, d_head: int, score: DotScore | AdditiveScore, window: int | None = None,
                 softcap: float | None = None) -> None:
        self.layer = layer
        self.scale = score.scale if isinstance(score, DotScore) else d_head**-0.5
        self.score = score
        if (window is not None or softcap is not None) and not isinstance(score, DotScore):
            raise ValueError("sliding windows and soft-capping are only available for dot-product attention")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.softcap = softcap

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata,
                 cache: KVCache, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, Hq, d), k/v (T, Hkv, d) -> (T, Hq, d); writes this step's K/V into `cache` first.
        `sinks` (Hq,): attention sinks' logits (gpt-oss), or None."""
        k = self.score.project_keys(k)
        cache.update(self.layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        fused = self.has_kernel(sinks is not None)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], meta, cache, fused, sinks)
        for chunk in meta.prefills:
            sl = slice(chunk.start, chunk.start + chunk.length)
            if chunk.context_len == chunk.length:  # nothing cached before it: its own K/V are the context
                out[sl] = self._attend_chunk(q[sl], k[sl], v[sl], 0, 0, sinks)
            else:
                out[sl] = self._prefill(q[sl], chunk.block_table, chunk.context_len, cache, meta, fused, sinks)
        if meta.capture is not None:  # an attention request's recompute (model/inspect/attention_maps.py)
            meta.capture.record(self, q, meta, cache, sinks)
        return out

    def has_kernel(self, sinks: bool) -> bool:
        """Whether this layer's reads of the cache can go through a backend's kernels (else the
        gather path): soft-capped or sink scores, and additive ones, have none (the
        explicit-softmax reference runs them)."""
        return isinstance(self.score, DotScore) and self.softcap is None and not sinks

    def _decode(self, q: torch.Tensor, meta: AttnMetadata, cache: KVCache, fused: bool,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence: q (B, Hq, d) against each sequence's cached past -> (B, Hq, d)."""
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        if meta.decode_kernel is not None and fused:
            return meta.decode_kernel(q, cache.keys[self.layer], cache.values[self.layer], meta.decode_block_tables,
                                      meta.decode_context_lens, self.scale, self.window)
        k, v = cache.gather(self.layer, meta.decode_block_tables)  # (B, S_blocks, Hkv, d)
        s = meta.decode_max_context
        k, v = k[:, :s].transpose(1, 2).to(q.dtype), v[:, :s].transpose(1, 2).to(q.dtype)  # (B, Hkv, S, d)
        mask = meta.decode_window_mask(self.window)  # (B, 1, 1, S)
        if self.softcap is not None or sinks is not None:
            return eager_attention(q.unsqueeze(2), k, v, mask, self.scale, self.softcap, sinks).squeeze(2)
        return self.score.attend(q.unsqueeze(2), k, v, mask=mask).squeeze(2)

    def _prefill(self, q: torch.Tensor, block_table: torch.Tensor, context_len: int, cache: KVCache,
                 meta: AttnMetadata, fused: bool, sinks: torch.Tensor | None) -> torch.Tensor:
        """A chunk of L queries at the end of a context of `context_len` positions -> (L, Hq, d)."""
        length = q.shape[0]
        if meta.prefill_kernel is not None and fused and length <= FUSED_PREFILL_MAX_QUERIES:
            return meta.prefill_kernel(q, cache.keys[self.layer], cache.values[self.layer], block_table,
                                       context_len, self.scale, self.window)
        start = context_len - length  # position of the chunk's first query
        # With a window, only the blocks holding positions the first query can still see are read.
        first_key = 0 if self.window is None else max(0, start - self.window + 1)
        first_block = first_key // cache.block_size
        k, v = cache.gather(self.layer, block_table[None, first_block:])  # (1, S_blocks, Hkv, d)
        k_start = first_block * cache.block_size
        k, v = k[0, : context_len - k_start], v[0, : context_len - k_start]
        return self._attend_chunk(q, k, v, start, k_start, sinks)

    def _attend_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, k_start: int,
                      sinks: torch.Tensor | None) -> torch.Tensor:
        """q (L, Hq, d) at positions start .. start + L - 1 over k/v (S, Hkv, d) at positions
        k_start .. k_start + S - 1, causal (and windowed) -> (L, Hq, d)."""
        q_, k_, v_ = (z.transpose(0, 1)[None].to(q.dtype) for z in (q, k, v))  # (1, H, L or S, d)
        if self.window is None and self.softcap is None and sinks is None:
            return self.score.attend(q_, k_, v_, causal_offset=start - k_start)[0].transpose(0, 1)
        mask = band_mask(q.shape[0], k.shape[0], start, k_start, self.window, q.device)  # (L, S)
        if self.softcap is not None or sinks is not None:
            out = eager_attention(q_, k_, v_, mask, self.scale, self.softcap, sinks)
        else:
            out = self.score.attend(q_, k_, v_, mask=mask)
        return out[0].transpose(0, 1)


class MultiHeadAttention(nn.Module):
    """The paper's (and GPT-2's) attention: one fused Q/K/V projection, h heads of
    d_k = d_v = d_model / h, a scoring function over the paged cache, output projection."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = Linear(cfg.d_model, cfg.d_model)
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
