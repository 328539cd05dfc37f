"""`EngineConfig.kv_cache_dtype`: the cache is stored in the asked-for type, the same byte budget
holds twice the blocks at 16 bits, and generation stays close to a float32 cache."""

from __future__ import annotations

import random

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig

KV_BYTES = 16 << 20  # 42 float32 blocks of transformer-base: 672 tokens, so max_model_len 512


def prompts_and_params(n: int = 4) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 60))] for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]


def generate(model: str, kv: str, fused: bool = True) -> tuple[LLM, list, list[torch.Tensor]]:
    llm = LLM(model, engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES, kv_cache_dtype=kv, block_size=8,
                                                                max_model_len=512))
    runner = llm.engine.runner
    runner.fused_decode = fused and runner.fused_available
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits.append(compute(h)) or logits[-1]
    prompts, params = prompts_and_params()
    return llm, llm.generate(prompts, params), logits


def test_kv_cache_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float16, float32; got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("kv,dtype", [("auto", torch.float32), ("float32", torch.float32),
                                      ("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_cache_is_stored_in_the_chosen_dtype_and_16_bits_hold_twice_the_blocks(kv: str, dtype: torch.dtype) -> None:
    llm = LLM("transformer-base", engine_config=EngineConfig(kv_cache_memory_bytes=KV_BYTES, kv_cache_dtype=kv,
                                                             max_model_len=512))
    cache = llm.engine.runner.cache
    assert {t.dtype for t in cache.keys + cache.values} == {dtype}
    per_block = 2 * 6 * 16 * 512 * dtype.itemsize  # K and V, layers, block size, d_model
    assert llm.engine.runtime.num_kv_blocks == KV_BYTES // per_block


@pytest.fixture(scope="module")
def fp32_run() -> tuple[list, list[torch.Tensor]]:
    _, outs, logits = generate("transformer-base", "float32")
    return outs, logits


@pytest.mark.parametrize("kv", ["bfloat16", "float16"])
def test_16_bit_cache_stays_close_to_float32(fp32_run, kv: str) -> None:
    ref_outs, ref_logits = fp32_run
    _, outs, logits = generate("transformer-base", kv)
    # Before any greedy choice differs the two runs see the same tokens, so their logits compare.
    first = [next((i for i, (a, b) in enumerate(zip(o.token_ids, r.token_ids)) if a != b), len(o.token_ids))
             for o, r in zip(outs, ref_outs)]
    agree = sum(first) / sum(len(r.token_ids) for r in ref_outs)
    worst = max((a - b).abs().max().item() for a, b in zip(logits[:3], ref_logits[:3]))
    assert agree >= 0.9, f"greedy agreement with a float32 cache only {agree:.2f}"
    assert worst < 0.05  # measured: 6e-4 (bfloat16), 7e-5 (float16) on logits of magnitude ~15


def test_fused_kernel_equals_gather_path_on_a_16_bit_cache() -> None:
    _, fused_outs, fused = generate("transformer-base", "bfloat16", fused=True)
    _, gather_outs, gather = generate("transformer-base", "bfloat16", fused=False)
    assert [o.token_ids for o in fused_outs] == [o.token_ids for o in gather_outs]
    assert max((a - b).abs().max().item() for a, b in zip(fused, gather)) < 1e-4


def test_additive_attention_runs_on_a_16_bit_cache() -> None:
    _, outs, _ = generate("transformer-base-additive", "bfloat16", fused=False)
    assert all(len(o.token_ids) == 12 for o in outs)


def test_kv_cache_dtype_is_an_app_argument() -> None:
    from pydantic import ValidationError

    from service.app import AppArgs

    assert AppArgs(kv_cache_dtype="bfloat16").engine_config()["kv_cache_dtype"] == "bfloat16"
    assert EngineConfig(**AppArgs().engine_config()).kv_cache_dtype == "auto"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        AppArgs(kv_cache_dtype="int8")
