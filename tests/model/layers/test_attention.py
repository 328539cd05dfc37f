"""Attention: the paper's scaling claim, and KV-cache decoding equal to full recomputation
for both attention implementations, through the paged cache."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import PRESETS
from model.layers.attention import ADDITIVE_CHUNK_ELEMS, AdditiveScore
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.loading.loading import build_preset

# fp32 logits of the 6-layer base model agree to this between the two paths.
KV_TOLERANCE = 1e-4


def test_scaling_keeps_scores_at_unit_variance_and_softmax_unsaturated() -> None:
    gen = torch.Generator().manual_seed(0)
    d_k, n = 64, 4096
    q = torch.randn(n, d_k, generator=gen)
    k = torch.randn(n, d_k, generator=gen)
    unscaled = (q * k).sum(-1)  # one q.k per pair: variance d_k
    scaled = unscaled / math.sqrt(d_k)
    assert unscaled.std().item() == pytest.approx(8.0, rel=0.05)
    assert scaled.std().item() == pytest.approx(1.0, rel=0.05)
    # Softmax over 64 keys per query: saturated without scaling, spread with it.
    qs = torch.randn(256, d_k, generator=gen)
    ks = torch.randn(64, d_k, generator=gen)
    p_unscaled = torch.softmax(qs @ ks.T, dim=-1).max(-1).values.mean().item()
    p_scaled = torch.softmax(qs @ ks.T / math.sqrt(d_k), dim=-1).max(-1).values.mean().item()
    assert p_unscaled > 0.7  # one key takes most of the mass
    assert p_scaled < 0.2  # mass spread over many keys


def prefill_meta(start: int, length: int, table: torch.Tensor, block_size: int) -> AttnMetadata:
    pos = torch.arange(start, start + length)
    slots = table[pos // block_size] * block_size + pos % block_size
    return AttnMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, length, start + length, table)])


def decode_meta(pos: int, table: torch.Tensor, block_size: int) -> AttnMetadata:
    slot = table[pos // block_size] * block_size + pos % block_size
    return AttnMetadata(slot_mapping=slot.view(1), num_decode=1, decode_block_tables=table[None],
                        decode_context_lens=torch.tensor([pos + 1]), decode_max_context=pos + 1)


@pytest.mark.parametrize("preset", ["transformer-base", "transformer-base-additive"])
@torch.no_grad()
def test_prefill_then_decode_equals_full_recompute(preset: str) -> None:
    cfg, bs, n = PRESETS[preset], 8, 45
    model = build_preset(preset).eval()
    tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3))
    # Scattered, non-contiguous blocks: the paging must not matter.
    table = torch.tensor([9, 2, 7, 0, 5, 11], dtype=torch.long)

    def new_cache() -> KVCache:
        return KVCache(cfg.n_layers, 12, bs, cfg.n_heads, cfg.d_head, torch.float32, "cpu")

    full = model.compute_logits(model(tokens, torch.arange(n), prefill_meta(0, n, table, bs), new_cache()))
    cache = new_cache()
    steps = [model.compute_logits(model(tokens[:20], torch.arange(20), prefill_meta(0, 20, table, bs), cache))]
    # A chunk in the middle (chunked prefill), then one token at a time.
    steps.append(model.compute_logits(model(tokens[20:30], torch.arange(20, 30),
                                            prefill_meta(20, 10, table, bs), cache)))
    for p in range(30, n):
        steps.append(model.compute_logits(model(tokens[p:p + 1], torch.tensor([p]), decode_meta(p, table, bs), cache)))
    incremental = torch.cat(steps)
    assert incremental.shape == full.shape == (n, cfg.vocab_size)
    assert (incremental - full).abs().max().item() < KV_TOLERANCE


def test_additive_attention_chunks_long_prefills(monkeypatch) -> None:
    """Chunking over queries gives the same result as one pass and bounds the temporary size."""
    torch.manual_seed(0)
    score = AdditiveScore(n_heads=2, d_head=8)
    for p in score.parameters():
        torch.nn.init.normal_(p, std=0.3)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    whole = score.attend(q, k, v, None, causal_offset=0)
    built: list[int] = []
    real_tanh = torch.tanh
    monkeypatch.setattr("model.layers.attention.ADDITIVE_CHUNK_ELEMS", 2 * 40 * 8 * 5)  # 5 queries per chunk
    monkeypatch.setattr(torch, "tanh", lambda x: built.append(x.numel()) or real_tanh(x))
    chunked = score.attend(q, k, v, None, causal_offset=0)
    assert torch.allclose(whole, chunked, atol=1e-6)
    # 8 chunks of 5 queries, each scoring only the keys it can see (causal).
    assert built == [2 * 5 * (5 * (i + 1)) * 8 for i in range(8)]
    assert ADDITIVE_CHUNK_ELEMS >= 1 << 20  # chunks large enough to keep BLAS busy


def test_additive_scores_follow_bahdanau() -> None:
    """e_ij = v^T tanh(W_q q_i + W_k k_j), softmax over j, weights applied to V."""
    torch.manual_seed(1)
    score = AdditiveScore(n_heads=1, d_head=4)
    for p in score.parameters():
        torch.nn.init.normal_(p)
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    got = score.attend(q, score.project_keys(k[0].transpose(0, 1)).transpose(0, 1)[None], v, None)
    wq, wk, vv = score.w_q[0], score.w_k[0], score.v[0]
    e = torch.stack([torch.stack([vv @ torch.tanh(q[0, 0, i] @ wq + k[0, 0, j] @ wk) for j in range(5)])
                     for i in range(3)])
    assert torch.allclose(got[0, 0], torch.softmax(e, -1) @ v[0, 0], atol=1e-5)
