"""Per-head attention weights of one request, computed explicitly through the model's own layers.

`capture_attention` runs the request's tokens once more through the model as one prefill into
a private KV cache, with an `AttentionCapture` in the step metadata. `PagedAttention` (the seam
every architecture calls) hands the capture its queries and cached keys; the capture computes
the weights with an explicit reference computation that the fused and SDPA paths never do:

- dot: softmax(q k^T * scale) under the causal mask, query head h reading KV head
  h // (Hq / Hkv) (grouped-query attention); `scale` is the model's own (1/sqrt(d_k), or
  Gemma's query_pre_attn_scalar), or 1 for the request's `scale: "none"` (the hidden states are
  always the model's own). What the layer's own attention does to the scores is done here too:
  a sliding window masks keys more than `window - 1` positions before the row, Gemma 2's
  soft-cap turns scores s into tanh(s / cap) * cap (with the model's scale; `scale: "none"`
  shows the raw q.k), and gpt-oss's sink logit joins each row's softmax denominator, so a row's
  weights sum to less than 1 (the rest went to the sink), as HF's `output_attentions` gives them.
- additive: softmax(v^T tanh(W_q q + W_k k)) with the layer's own parameters.

Only the requested layers, heads and query rows are materialised. Keys after a row's
position, or outside its window, get weight exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from model.inspect.attention_spec import AttentionShape, AttentionSpec
from model.layers.attention import AdditiveScore
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk

ADDITIVE_CHUNK_ELEMS = 1 << 22  # bound on the (R, h, S, d) tanh features built at once


@dataclass
class AttentionMaps:
    """The answer: `weights` (layers, heads, rows, keys) float32 on the CPU, and per (layer,
    head) the pre-softmax score standard deviation over the visible (row, key) pairs and the
    mean row entropy (nats)."""

    token_ids: list[int]
    shape: AttentionShape
    layers: list[int]
    heads: list[int]
    rows: list[int]
    scale: str
    weights: torch.Tensor  # (L, H, R, S)
    score_std: torch.Tensor  # (L, H)
    entropy: torch.Tensor  # (L, H)
    # Vision models: each image's (offset, length, rows, cols) among the tokens (ImageItem.grid:
    # token offset + j shows patch j - (length - rows * cols) of the row-major grid).
    images: list[tuple[int, int, int, int]] = field(default_factory=list)


class AttentionCapture:
    """Collects explicit weights for the chosen layers, heads and rows of a one-sequence prefill."""

    def __init__(self, layers: list[int], heads: list[int], rows: list[int], unscaled: bool) -> None:
        self.layers, self.heads, self.rows = layers, heads, rows
        self.unscaled = unscaled
        self.weights: dict[int, torch.Tensor] = {}
        self.score_std: dict[int, torch.Tensor] = {}
        self.entropy: dict[int, torch.Tensor] = {}

    def record(self, attn: object, q: torch.Tensor, meta: AttnMetadata, cache: KVCache,
               sinks: torch.Tensor | None = None) -> None:
        """Called by `PagedAttention` after it wrote this step's K/V: q (T, Hq, d) of the
        single prefill chunk that covers the whole sequence; `sinks` (Hq,) the layer's sink logits."""
        layer = attn.layer  # type: ignore[attr-defined]
        if layer not in self.layers:
            return
        (chunk,) = meta.prefills
        assert chunk.start == 0 and chunk.length == chunk.context_len, "capture needs a whole-sequence prefill"
        keys, _ = cache.gather(layer, chunk.block_table[None])  # (1, S_blocks, Hkv, d)
        s = chunk.context_len
        k = keys[0, :s].float()  # (S, Hkv, d)
        rows = torch.tensor(self.rows, dtype=torch.long, device=q.device)
        heads = torch.tensor(self.heads, dtype=torch.long, device=q.device)
        qr = q[rows][:, heads].float()  # (R, h, d)
        group = q.shape[1] // k.shape[1]  # query heads per KV head
        scores = self._scores(attn, qr, k, heads, group)  # (h, R, S)
        keys = torch.arange(s, device=q.device)[None, :]
        visible = keys <= rows[:, None]  # (R, S)
        window = getattr(attn, "window", None)
        if window is not None:
            visible = visible & (keys > rows[:, None] - window)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = _softmax(scores, None if sinks is None else sinks[heads].float())  # (h, R, S); masked: 0
        self.weights[layer] = weights.cpu()
        self.score_std[layer] = _masked_std(scores, visible).cpu()
        logs = torch.where(weights > 0, weights.log(), torch.zeros_like(weights))
        self.entropy[layer] = (-(weights * logs).sum(-1)).mean(-1).cpu()  # (h,)

    def _scores(self, attn: object, q: torch.Tensor, k: torch.Tensor, heads: torch.Tensor,
                group: int) -> torch.Tensor:
        """q (R, h, d) of the chosen heads, k (S, Hkv, d) cached keys -> scores (h, R, S)."""
        score = attn.score  # type: ignore[attr-defined]
        if isinstance(score, AdditiveScore):
            return _additive_scores(score, q, k, heads)
        kh = k[:, heads // group]  # (S, h, d): query head h reads KV head h // group
        if self.unscaled:
            return torch.einsum("rhd,shd->hrs", q, kh)
        scores = torch.einsum("rhd,shd->hrs", q, kh) * attn.scale  # type: ignore[attr-defined]
        softcap = getattr(attn, "softcap", None)
        return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Row softmax of scores (h, R, S); with sinks (h,), each head's sink logit joins every row's
    denominator (a column dropped afterwards), as gpt-oss's attention computes it."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    h, r, _ = scores.shape
    logits = torch.cat([scores, sinks.view(h, 1, 1).expand(h, r, 1)], dim=-1)  # (h, R, S + 1)
    return torch.softmax(logits, dim=-1)[..., :-1]


def _additive_scores(score: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """v_h^T tanh(W_q,h q + W_k,h k) with k already projected (the cache holds W_k k): (h, R, S)."""
    w_q, v = score.w_q[heads].float(), score.v[heads].float()  # (h, d, d), (h, d)
    qp = torch.einsum("rhd,hde->rhe", q, w_q)  # (R, h, d)
    kh = k[:, heads]  # (S, h, d)
    r, h, d = qp.shape
    step = max(1, ADDITIVE_CHUNK_ELEMS // max(1, h * k.shape[0] * d))
    out = []
    for i in range(0, r, step):
        feats = torch.tanh(qp[i:i + step, :, None, :] + kh.transpose(0, 1)[None])  # (c, h, S, d)
        out.append(torch.einsum("chsd,hd->hcs", feats, v))
    return torch.cat(out, dim=1)


def _masked_std(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of scores (h, R, S) over the visible (R, S) entries: (h,)."""
    n = visible.sum()
    vals = torch.where(visible, scores, torch.zeros_like(scores))
    mean = vals.sum((-1, -2)) / n
    dev = torch.where(visible, scores - mean[:, None, None], torch.zeros_like(scores))
    return (dev.pow(2).sum((-1, -2)) / n).sqrt()


@torch.inference_mode()
def capture_attention(model: torch.nn.Module, shape: AttentionShape, token_ids: list[int], spec: AttentionSpec,
                      block_size: int = 16, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                      mrope_positions: torch.Tensor | None = None) -> AttentionMaps:
    """Run `token_ids` through `model` once (a private cache; the engine's is not touched) and
    return the weights `spec` asks for. A vision model's images come in as the step metadata's
    `mm_embeds` and `mrope_positions` (model/layers/kv_cache.py)."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    layers, heads = spec.resolve_layers(shape), spec.resolve_heads(shape)
    rows = spec.resolve_rows(len(token_ids))
    capture = AttentionCapture(layers, heads, rows, unscaled=spec.scale == "none")
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size)
    cache = KVCache(shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.d_head, dtype, device)
    table = torch.arange(num_blocks, dtype=torch.long, device=device)
    meta = AttnMetadata(slot_mapping=torch.arange(n, dtype=torch.long, device=device),
                        prefills=[PrefillChunk(0, n, n, table)], capture=capture, mm_embeds=mm_embeds,
                        mrope_positions=mrope_positions)
    tokens = torch.tensor(token_ids, dtype=torch.long, device=device)
    model(tokens, torch.arange(n, dtype=torch.long, device=device), meta, cache)
    return AttentionMaps(
        token_ids=list(token_ids), shape=shape, layers=layers, heads=heads, rows=rows, scale=spec.scale,
        weights=torch.stack([capture.weights[i] for i in layers]),
        score_std=torch.stack([capture.score_std[i] for i in layers]),
        entropy=torch.stack([capture.entropy[i] for i in layers]))
