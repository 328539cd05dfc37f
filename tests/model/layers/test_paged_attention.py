"""The fused paged-attention kernel against the reference gather path, at the kernel's own
interface: ragged batches, scattered block tables with stale entries, contexts crossing many
blocks, grouped-query attention, float32/bfloat16/float16 caches, prefill chunks."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.engine import runner as runner_module
from model.layers import paged_attention as pa

TOL_FP32 = 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    # The suite builds the kernel once per machine (into ~/.cache/qkv-serve); it must build here.
    assert pa.kernel_available(), "the fused paged-attention kernel did not build"


def make_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, hkv, d)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def ragged_tables(lens: list[int], block_size: int, num_blocks: int, seed: int = 1) -> torch.Tensor:
    """Each sequence gets distinct scattered blocks; the padding past its context points at
    blocks that belong to others (stale entries the kernel must not read)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    order = torch.randperm(num_blocks, generator=gen)
    rows, used = [], 0
    for n in lens:
        own = -(-n // block_size)
        row = order[used:used + own].tolist()
        used += own
        rows.append(row + order[:width - own].tolist())  # holes filled with other sequences' blocks
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_equals_gather_for_ragged_batches(hq: int, hkv: int, dtype: torch.dtype) -> None:
    bs, d = 4, 64
    lens = [1, 3, 4, 5, 37, 300]  # within one block, exactly one block, 75 blocks
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    kc, vc = make_cache(num_blocks, bs, hkv, d, dtype)
    tables = ragged_tables(lens, bs, num_blocks)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(2))
    ctx = torch.tensor(lens)
    fused = pa.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    ref = pa.gather_decode_attention(q, kc, vc, tables, ctx, d**-0.5)  # reads the same rounded cache
    assert fused.shape == (len(lens), hq, d) and fused.dtype == q.dtype
    torch.testing.assert_close(fused, ref, atol=TOL_FP32, rtol=0)


def test_decode_never_reads_past_a_context() -> None:
    bs, hkv, d = 8, 2, 12  # d not a multiple of the vector width (16): the plain loops
    lens = [5, 9, 16]
    kc, vc = make_cache(12, bs, hkv, d, torch.float32)
    tables = ragged_tables(lens, bs, 12)
    q = torch.randn(3, hkv, d)
    ctx = torch.tensor(lens)
    before = pa.paged_decode_attention(q, kc, vc, tables, ctx, 0.25)
    # Poison every cache row outside the three contexts.
    keep = torch.zeros(12, bs, dtype=torch.bool)
    for row, n in zip(tables.tolist(), lens):
        for p in range(n):
            keep[row[p // bs], p % bs] = True
    kc[~keep] = float("nan")
    vc[~keep] = float("inf")
    after = pa.paged_decode_attention(q, kc, vc, tables, ctx, 0.25)
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    kc[~keep], vc[~keep] = 0.0, 0.0
    torch.testing.assert_close(after, pa.gather_decode_attention(q, kc, vc, tables, ctx, 0.25), atol=TOL_FP32, rtol=0)


@pytest.mark.parametrize("length,context", [(1, 1), (7, 7), (5, 43), (40, 100)])
def test_prefill_chunk_equals_gather(length: int, context: int) -> None:
    bs, hq, hkv, d = 16, 6, 3, 32
    kc, vc = make_cache(20, bs, hkv, d, torch.float32)
    table = torch.randperm(20, generator=torch.Generator().manual_seed(4))[:8]
    q = torch.randn(length, hq, d)
    fused = pa.paged_prefill_attention(q, kc, vc, table, context, d**-0.5)
    ref = pa.gather_prefill_attention(q, kc, vc, table, context, d**-0.5)
    torch.testing.assert_close(fused, ref, atol=TOL_FP32, rtol=0)


def test_bad_shapes_are_refused_with_a_message() -> None:
    kc, vc = make_cache(4, 4, 2, 8, torch.float32)
    tables = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="num_keys"):
        pa.paged_decode_attention(torch.randn(1, 2, 8), kc, vc, tables, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        pa.paged_decode_attention(torch.randn(1, 3, 8), kc, vc, tables, torch.tensor([3]), 1.0)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise OSError("g++: not found")

    saved = dict(pa._state)
    monkeypatch.setenv("QKV_KERNEL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    pa._state.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="model.layers.paged_attention"):
            assert not pa.use_fused(torch.device("cpu"))
            assert not pa.use_fused(torch.device("cpu"))
        assert [r.getMessage() for r in caplog.records] == [
            "fused paged attention unavailable, using the gather path: OSError: g++: not found"]
    finally:
        pa._state.clear()
        pa._state.update(saved)


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_one(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """torch's build lock is a plain file: a build killed midway leaves it, and torch would wait
    for it forever (an engine that never starts). The next build removes it first."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("QKV_KERNEL_CACHE", str(tmp_path))
    directory = pa.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    seen: list[bool] = []

    def build(*args, **kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        raise OSError("stop here")

    saved = dict(pa._state)
    monkeypatch.setattr(cpp_extension, "load", build)
    pa._state.clear()
    try:
        assert not pa.kernel_available()
        assert seen == [False]
    finally:
        pa._state.clear()
        pa._state.update(saved)


# ---- the engine with the fused kernel against the engine with the gather path -------------

def run_engine(model: str, fused: bool, prompts: list[list[int]], params: list[SamplingParams],
               **engine_kw) -> tuple[list, list[torch.Tensor]]:
    """Generate with decode attention through the kernel or the gather path; also return the
    logits of every step."""
    llm = LLM(model, engine_config=EngineConfig(**engine_kw))
    runner = llm.engine.runner
    assert runner.fused_available
    runner.fused_decode = fused
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits.append(compute(h)) or logits[-1]
    return llm.generate(prompts, params), logits


@pytest.fixture(scope="module", params=["transformer-base", "llama-gqa"])
def model_name(request, tmp_path_factory) -> str:
    if request.param == "transformer-base":
        return request.param
    from tests.support.tiny_models import write_tiny_llama  # tests/ is on the path under pytest

    # 4 query heads over 2 KV heads, head size 32 (not d_model / n_heads).
    return str(write_tiny_llama(tmp_path_factory.mktemp("llama-gqa"), head_dim=32))


def test_engine_logits_and_greedy_tokens_equal_the_gather_path(model_name: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged batch whose prompts are chunked across steps, so that prefill chunks (long and
    short, after a cached past) and decodes share steps; small blocks, so contexts cross many of
    them and tables are scattered (blocks of finished requests are reused), padded with stale
    entries. Both kernels (decode and short-chunk prefill) against the gather path."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 70))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True) for _ in prompts]
    kw = dict(block_size=4, max_num_batched_tokens=40, max_num_seqs=8, num_kv_blocks=160)
    calls = {"decode": 0, "prefill": 0}
    for kind in calls:
        real = getattr(runner_module, f"paged_{kind}_attention")
        monkeypatch.setattr(runner_module, f"paged_{kind}_attention",
                            lambda *a, _real=real, _kind=kind: calls.__setitem__(_kind, calls[_kind] + 1) or _real(*a))
    fused, fused_logits = run_engine(model_name, True, prompts, params, **kw)
    assert calls["decode"] > 0 and calls["prefill"] > 0  # both kernels ran
    gather, gather_logits = run_engine(model_name, False, prompts, params, **kw)
    assert [o.token_ids for o in fused] == [o.token_ids for o in gather]
    assert len(fused_logits) == len(gather_logits) > 30
    worst = max((a - b).abs().max().item() for a, b in zip(fused_logits, gather_logits))
    assert worst < TOL_FP32
