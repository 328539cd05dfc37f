"""The compiled FlexAttention path (`FlexPagedAttention(compiled=True)`, what CUDA runs) on the CPU:
torch.compile of flex_attention runs here too, and like the CUDA kernel it visits only the blocks
each row's block mask lists. So the padding the compiled path adds (a prefill chunk to a power of
two queries, a decode batch to a power of two rows) is checked against a dense reference here:
padded chunks, short tails after a cached prefix, rows that own physical block 0 (where the
padding entries of a block list point), sliding windows, decode batches of sizes that are not
powers of two. And the block mask is built once per step, not once per layer, whatever the batch.

Not covered here: one row with one query (a decode batch of 1), whose CPU kernel torch 2.13's
inductor fails to compile (its flex template names `full_kv_num_blocks`, which it does not
declare); the CUDA kernel is another template, run by `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.layers.flex_attention import FlexPagedAttention

NUM_BLOCKS, BS, HKV, HQ, D = 40, 16, 2, 4, 16  # a block of 16: what the compiled kernel needs on CUDA
SCALE = D**-0.5


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: list[int], context_len: int,
              window: int | None) -> torch.Tensor:
    """q (L, Hq, d), the last L positions of one sequence -> (L, Hq, d), dense, in float32."""
    length = q.shape[0]
    k = kc[table].reshape(-1, HKV, D)[:context_len].transpose(0, 1)[None]  # (1, Hkv, S, d)
    v = vc[table].reshape(-1, HKV, D)[:context_len].transpose(0, 1)[None]
    qpos = torch.arange(context_len - length, context_len)[:, None]
    kpos = torch.arange(context_len)[None, :]
    mask = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.fixture(scope="module")
def pool() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (NUM_BLOCKS, BS, HKV, D)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.fixture(scope="module")
def compiled() -> FlexPagedAttention:
    return FlexPagedAttention(NUM_BLOCKS, BS, "cpu", compiled=True)


# (block table, context length, chunk length, window): chunks padded past a block boundary of a
# context that fills its blocks exactly (the padding once listed a block past the table: physical
# block 0, owned by the row here), short tails after a cached prefix, a window.
PREFILLS = [
    ([0, 3], 32, 3, None),
    ([3, 0], 32, 3, None),
    ([7, 0, 12], 48, 5, None),
    ([0, 9, 4], 40, 2, None),
    ([0, 9, 4], 47, 6, None),
    ([5, 0, 2, 11], 64, 7, 20),
    ([0], 16, 16, None),
]


@pytest.mark.parametrize("table,context_len,length,window", PREFILLS)
def test_compiled_prefill_chunk_equals_the_dense_reference(compiled, pool, table, context_len, length, window):
    kc, vc = pool
    q = torch.randn(length, HQ, D, generator=torch.Generator().manual_seed(context_len + length))
    compiled.new_step()
    out = compiled.prefill(q, kc, vc, torch.tensor(table), context_len, SCALE, window=window)
    assert (out - reference(q, kc, vc, table, context_len, window)).abs().max().item() < 1e-5


def _ragged_batch(b: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """b rows of distinct physical blocks (row 0 owns block 0), ragged lengths 1 .. 4 blocks."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 4 * BS + 1, (b,), generator=g).tolist()
    width = max(-(-n // BS) for n in lens)
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    tables, k = [], 0
    for i, n in enumerate(lens):
        used = -(-n // BS)
        row = [0] + perm[k:k + used - 1] if i == 0 else [perm[(k + j) % len(perm)] for j in range(used)]
        k += used
        tables.append(row + [0] * (width - used))  # padded with 0, as the runner pads a decode batch
    return tables, lens


@pytest.mark.parametrize("batch", [3, 6, 12, 33])
def test_compiled_decode_batch_equals_the_dense_reference(compiled, pool, batch) -> None:
    kc, vc = pool
    tables, lens = _ragged_batch(batch, seed=batch)
    q = torch.randn(batch, HQ, D, generator=torch.Generator().manual_seed(batch))
    compiled.new_step()
    out = compiled.decode(q, kc, vc, torch.tensor(tables), torch.tensor(lens), SCALE)
    for i, (table, n) in enumerate(zip(tables, lens)):
        ref = reference(q[i:i + 1], kc, vc, table[: -(-n // BS)], n, None)[0]
        assert (out[i] - ref).abs().max().item() < 1e-5, (batch, i)


@pytest.mark.parametrize("batch", [1, 3, 5, 12, 33, 64])
def test_block_mask_built_once_per_step_for_any_batch_size(batch) -> None:
    """Each layer calls decode with the step's tensors; a padded batch must still find its plan."""
    flex = FlexPagedAttention(NUM_BLOCKS, BS, "cpu", compiled=True)
    tables, lens = _ragged_batch(batch, seed=batch)
    tables_t, lens_t = torch.tensor(tables), torch.tensor(lens)
    flex.new_step()
    masks = {id(flex._mask((tables_t, lens_t, 1, None), tables_t, lens_t, 1, None))}
    built = []
    real_mask = flex._mask

    def counting_mask(*args, **kwargs):
        mask = real_mask(*args, **kwargs)
        built.append(id(mask))
        return mask

    flex._mask = counting_mask
    flex._attend = lambda q, *args: q  # the kernel is not what this test is about
    for _layer in range(3):
        flex.decode(torch.zeros(batch, HQ, D), None, None, tables_t, lens_t, SCALE)
    assert len(flex._plans) == 1 and set(built) == masks
