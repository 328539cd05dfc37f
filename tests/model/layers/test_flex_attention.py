"""The FlexAttention backend (model/layers/flex_attention.py) against the gather path, on the CPU
(FlexAttention's unfused reference; the compiled CUDA kernel is checked by tests/gpu/test_gpu_engine.py on a GPU):
ragged decode batches, prefill chunks after a cached past, both in one step, block tables with
holes (scattered, non-increasing physical blocks), grouped-query attention, sliding windows,
16-bit caches; and the block mask, which is all the compiled kernel reads blocks by."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from model.engine.runner import choose_backend
from model.layers.attention import DotScore, PagedAttention
from model.layers.flex_attention import FlexPagedAttention, build_block_mask
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.layers.paged_attention import gather_decode_attention

NUM_BLOCKS, BS, HKV, HQ, D = 48, 4, 2, 4, 16
SCALE = D**-0.5
LENS = [1, 4, 5, 17, 30]  # ragged: one position, one full block, a block and one, ...
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def scattered_tables(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """(rows, width) distinct physical blocks in random order: holes, never increasing runs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g)[: rows * width].view(rows, width)


def pool(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BS, HKV, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, context_len: int,
              window: int | None) -> torch.Tensor:
    """q (L, Hq, d), the last L positions of one sequence, in float32 -> (L, Hq, d)."""
    length = q.shape[0]
    k = kc[table].reshape(-1, HKV, D)[:context_len].float().transpose(0, 1)[None]  # (1, Hkv, S, d)
    v = vc[table].reshape(-1, HKV, D)[:context_len].float().transpose(0, 1)[None]
    qpos = torch.arange(context_len - length, context_len)[:, None]
    kpos = torch.arange(context_len)[None, :]
    mask = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k, v, attn_mask=mask, scale=SCALE,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.fixture(scope="module")
def flex() -> FlexPagedAttention:
    return FlexPagedAttention(NUM_BLOCKS, BS, "cpu")


@pytest.fixture
def untraced(monkeypatch) -> None:
    """FlexAttention's unfused reference called directly instead of through dynamo, which traces
    it afresh for each new shape, dtype and window (seconds each on a 2-core machine): the same
    math (flex_attention_hop). The mixed-step test keeps the traced path the backend ships with."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float32, 6), (torch.bfloat16, None),
                                          (torch.float16, 6)])
def test_decode_equals_reference_on_ragged_batches_with_holes(flex, untraced, dtype, window) -> None:
    kc, vc = pool(dtype)
    tables = scattered_tables(len(LENS), 8)
    lens = torch.tensor(LENS)
    q = torch.randn(len(LENS), HQ, D).to(dtype)
    flex.new_step()
    out = flex.decode(q, kc, vc, tables, lens, SCALE, window=window)
    assert out.shape == q.shape and out.dtype == dtype
    ref = torch.cat([reference(q[b:b + 1], kc, vc, tables[b], n, window) for b, n in enumerate(LENS)])
    err = (out.float() - ref).abs().max().item()
    assert err < TOL[dtype]
    # The tolerance is far below what one position too few costs.
    short = torch.cat([reference(q[b:b + 1], kc, vc, tables[b], max(1, n - 1), window)
                       for b, n in enumerate(LENS)])
    assert (out.float() - short).abs().max().item() > 20 * TOL[dtype]
    if window is None:  # and equal to the gather reference of model/layers/paged_attention.py
        gathered = gather_decode_attention(q.float(), kc, vc, tables, lens, SCALE)
        assert (out.float() - gathered).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("length,context_len,window", [(1, 9, None), (5, 21, None), (16, 30, 7), (23, 29, None)])
def test_prefill_chunk_after_a_cached_past_equals_reference(flex, untraced, length, context_len, window) -> None:
    kc, vc = pool(torch.float32)
    table = scattered_tables(1, 8, seed=3)[0]
    q = torch.randn(length, HQ, D)
    flex.new_step()
    out = flex.prefill(q, kc, vc, table, context_len, SCALE, window=window)
    assert (out - reference(q, kc, vc, table, context_len, window)).abs().max().item() < 1e-5


@pytest.mark.parametrize("window", [None, 5])
def test_block_mask_lists_exactly_the_blocks_the_mask_sees(window) -> None:
    """The compiled kernel visits only each row's listed blocks: they must hold every key the
    mask admits (the unfused CPU reference evaluates the mask everywhere, so it cannot tell)."""
    tables = scattered_tables(len(LENS), 8, seed=5)
    lens = torch.tensor(LENS)
    for q_len in (1, 3):
        lens_q = torch.maximum(lens, torch.tensor(q_len))
        bm = build_block_mask(tables, lens_q, q_len, window, NUM_BLOCKS, BS)
        dense = create_mask(bm.mask_mod, len(LENS), 1, q_len, NUM_BLOCKS * BS, device="cpu")  # (B, 1, Lq, N*bs)
        seen_blocks = dense.view(len(LENS), q_len, NUM_BLOCKS, BS).any(dim=(1, 3))  # (B, N)
        for b, n in enumerate(lens_q.tolist()):
            used = -(-n // BS)
            listed = bm.kv_indices[b, 0, 0, : bm.kv_num_blocks[b, 0, 0]].tolist()
            assert listed == tables[b, :used].tolist()  # table order, nothing past the context
            assert set(seen_blocks[b].nonzero().flatten().tolist()) <= set(listed)
            assert int(dense[b].sum()) == sum(min(n - q_len + i + 1, window or n) for i in range(q_len))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_step_equals_the_gather_path(flex, kv_dtype) -> None:
    """One step through PagedAttention: three decode rows, a first chunk (own K/V), a short chunk
    after a cached past (the prefill kernel) and a long one (gather either way)."""
    cache = KVCache(1, NUM_BLOCKS, BS, HKV, D, kv_dtype, "cpu")
    g = torch.Generator().manual_seed(7)
    past = [torch.randn(NUM_BLOCKS * BS, HKV, D, generator=g) for _ in range(2)]  # cached K, V
    tables = scattered_tables(6, 8, seed=11)
    decode_lens = [3, 13, 26]  # contexts including this step's token
    chunks = [(6, 6), (4, 19), (20, 27)]  # (length, context_len)
    positions = [n - 1 for n in decode_lens] + [p for n, c in chunks for p in range(c - n, c)]
    rows = [0, 1, 2] + [3 + i for i, (n, _) in enumerate(chunks) for _ in range(n)]
    slots = torch.tensor([int(tables[r, p // BS]) * BS + p % BS for r, p in zip(rows, positions)])
    t = len(positions)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    attn = PagedAttention(0, D, DotScore(D))
    outs = []
    for kernels in (False, True):
        for layer, cached in zip((cache.keys[0], cache.values[0]), past):  # the same past for both runs
            layer.view(-1, HKV, D).copy_(cached)
        meta = AttnMetadata(slot_mapping=slots, num_decode=3, decode_block_tables=tables[:3],
                            decode_context_lens=torch.tensor(decode_lens), decode_max_context=max(decode_lens))
        start = 3
        for i, (n, c) in enumerate(chunks):
            meta.prefills.append(PrefillChunk(start, n, c, tables[3 + i]))
            start += n
        if kernels:
            flex.new_step()
            meta.decode_kernel, meta.prefill_kernel = flex.decode, flex.prefill
        outs.append(attn(q, k, v, meta, cache))
    assert (outs[0] - outs[1]).abs().max().item() < TOL[kv_dtype]


def test_backend_choice() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_backend("auto", cuda, 16) == "flex"
    assert choose_backend("auto", cuda, 8) == "gather"  # the Triton kernels need blocks of a multiple of 16 tokens
    assert choose_backend("flex", cpu, 4) == "flex" and choose_backend("gather", cuda, 16) == "gather"
    with pytest.raises(ValueError, match="multiple of 16"):
        choose_backend("flex", cuda, 8)
    with pytest.raises(ValueError, match="'fused' is the CPU kernel"):
        choose_backend("fused", cuda, 16)
