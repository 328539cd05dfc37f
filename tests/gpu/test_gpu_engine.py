"""Engine checks on the accelerator beyond test_gpu.py's parity (each written once, here;
loadtests/tools/device_check.py runs them with the rest of tests/gpu): the paper's Transformer
against its own dense forward; the flex kernels against the engine's gather path on 16-bit caches
at a real head size (windows, block tables with holes, a row owning block 0, padded prefill chunks
after a cached past); short prompt tails after a cached prefix; draft-model speculation with every
prompt at once; a long-context engine that reserves no gather workspace under flex (and, on CUDA,
stays within 256 MiB beyond its weights and KV pool); on CUDA, start-up sizing by a profiling run
and gpu_memory_utilization. Parity with HF (Qwen3's included) is test_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig, ModelConfig
from tests.support.requirements import need_module
from tests.support.tiny_models import write_tiny_llama

pytestmark = pytest.mark.gpu
need_module("transformers")

BLOCK = 16  # flex on CUDA needs a multiple of 16
PROMPTS = [torch.randint(1, 301, (9,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_the_papers_transformer_equals_its_dense_forward(device, tmp_path) -> None:
    from model.loading.checkpoint import save_model
    from model.models.registry import build_model

    net = build_model(ModelConfig(vocab_size=301, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=256))
    net.init_weights(0)
    save_model(net, tmp_path / "transformer")
    llm = LLM(str(tmp_path / "transformer"), device=device, dtype="float32", engine_config=EngineConfig(block_size=BLOCK))
    prompt = PROMPTS[0] * 3
    got = llm.generate([prompt], greedy(16))[0].token_ids
    model, ids = llm.engine.runner.model, list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(model.forward_train(torch.tensor([ids], device=device))[0, -1].argmax()))
    assert got == ids[len(prompt):]


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.bfloat16, 64), (torch.float16, None)])
@torch.inference_mode()
def test_flex_kernels_equal_the_gather_path_on_16_bit_caches(device, dtype, window) -> None:
    """Flex decode and prefill against PagedAttention's gather path over a scattered pool. The
    prefill row owns physical block 0 and two of its contexts fill their blocks exactly, so a
    padded chunk (3 -> 4, 5 -> 8 queries) would list a block past its table if the padding
    counted as context."""
    from model.layers.attention import DotScore, PagedAttention
    from model.layers.flex_attention import FlexPagedAttention
    from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk

    hq, hkv, d = (32, 8, 128) if device.startswith("cuda") else (4, 2, 16)
    ctx = 2048 if device.startswith("cuda") else 40
    lens = [1, BLOCK, BLOCK + 1, ctx // 3, ctx - 5, ctx]
    width = -(-ctx // BLOCK)
    num_blocks = len(lens) * width + 7
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    if not bool((tables[-1] == 0).any()):
        tables[-1, width // 2] = 0
    tables = tables.to(device)
    cache = KVCache(1, num_blocks, BLOCK, hkv, d, dtype, device)
    cache.keys[0].copy_(torch.randn(num_blocks, BLOCK, hkv, d, generator=g))
    cache.values[0].copy_(torch.randn(num_blocks, BLOCK, hkv, d, generator=g))
    attn = PagedAttention(0, d, DotScore(d), window=window)
    flex = FlexPagedAttention(num_blocks, BLOCK, device)
    flat_k, flat_v = (c.view(-1, *c.shape[2:]) for c in (cache.keys[0], cache.values[0]))

    def gather(q: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:  # the step's K/V are in their slots already
        return attn(q, flat_k[meta.slot_mapping], flat_v[meta.slot_mapping], meta, cache)

    q = torch.randn(len(lens), hq, d, generator=g).to(device, dtype)
    context = torch.tensor(lens, device=device)
    flex.new_step()
    got = flex.decode(q, cache.keys[0], cache.values[0], tables, context, attn.scale, window)
    slots = [int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(lens)]
    meta = AttnMetadata(slot_mapping=torch.tensor(slots, device=device), num_decode=len(lens),
                        decode_block_tables=tables, decode_context_lens=context, decode_max_context=max(lens))
    assert (got.float() - gather(q, meta).float()).abs().max() < 2e-2
    for length, context_len in ((3, ctx - 2), (5, (ctx // BLOCK) * BLOCK), (16, (ctx // BLOCK) * BLOCK)):
        qp = torch.randn(length, hq, d, generator=g).to(device, dtype)
        flex.new_step()
        got = flex.prefill(qp, cache.keys[0], cache.values[0], tables[-1], context_len, attn.scale, window)
        slots = [int(tables[-1, p // BLOCK]) * BLOCK + p % BLOCK for p in range(context_len - length, context_len)]
        meta = AttnMetadata(slot_mapping=torch.tensor(slots, device=device),
                            prefills=[PrefillChunk(0, length, context_len, tables[-1])])
        assert (got.float() - gather(qp, meta).float()).abs().max() < 2e-2, (length, context_len)


def test_short_tails_after_a_cached_prefix_equal_uncached(device, tmp_path) -> None:
    """A prompt again (its full blocks cached), then tails of 1, 3 and 5 tokens after its first two
    full blocks: a short prefill chunk after a cached past (the padded flex path)."""
    directory = write_tiny_llama(tmp_path / "llama", seed=7)
    base = (PROMPTS[0] * 6)[: 3 * BLOCK + 2]
    prompts = [base, base] + [base[: 2 * BLOCK] + [11 + i] * (1 + 2 * i) for i in range(3)]
    tokens, hits = {}, 0
    for caching in (True, False):
        llm = LLM(str(directory), device=device, dtype="float32",
                  engine_config=EngineConfig(block_size=BLOCK, max_num_seqs=8, enable_prefix_caching=caching))
        tokens[caching] = [llm.generate([p], greedy(8))[0].token_ids for p in prompts]
        hits = llm.engine.stats().prefix_cache_hits if caching else hits
    assert tokens[True] == tokens[False]
    assert hits >= 4 * 2 * BLOCK


def test_draft_model_speculation_with_every_prompt_at_once_equals_plain(device, tmp_path) -> None:
    """Every prompt at once, so speculation must stay on past the default disable_by_batch_size."""
    directory, draft = write_tiny_llama(tmp_path / "target", seed=8), write_tiny_llama(tmp_path / "draft", seed=9)
    prompts = [p * 3 for p in PROMPTS]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    runs = {}
    for name, config in (("plain", None), ("draft", spec)):
        llm = LLM(str(directory), device=device, dtype="float32", speculative_config=config,
                  engine_config=EngineConfig(block_size=BLOCK, max_num_seqs=8))
        runs[name] = [o.token_ids for o in llm.generate(prompts, greedy(16))]
    assert runs["draft"] == runs["plain"]
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0


def test_a_long_context_engine_reserves_no_gather_workspace_under_flex(device, tmp_path) -> None:
    """The gather workspace (max_num_seqs x the context's blocks) is never read by flex decode: not
    reserved, and on CUDA the peak beyond the weights and the KV pool stays small."""
    cuda = device.startswith("cuda")
    long = 131072 if cuda else 1024
    directory = write_tiny_llama(tmp_path / "long", seed=10, max_position_embeddings=long)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    llm = LLM(str(directory), device=device, dtype="float32",
              engine_config=EngineConfig(block_size=BLOCK, max_num_seqs=64 if cuda else 8, num_kv_blocks=512,
                                         max_model_len=long, attention_backend="flex", enforce_eager=False))
    llm.generate(PROMPTS, greedy(8))
    cache = llm.engine.runner.cache
    assert cache.workspace_blocks == 0
    if cuda:
        pool = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
        weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
        assert torch.cuda.max_memory_allocated() - before - pool - weights < 256 << 20
        assert llm.engine.runner.graphs.num_replays > 0


def test_cuda_start_up_profiles_and_sizes_the_cache_by_gpu_memory_utilization(device, tmp_path) -> None:
    """The profiling run measured an activation peak, and the cache stays inside the share left:
    utilization x total - weights - peak (fewer blocks when max_num_seqs sequences need fewer)."""
    if not device.startswith("cuda"):
        pytest.skip("the profiling run and gpu_memory_utilization are CUDA's")
    directory = write_tiny_llama(tmp_path / "m", max_position_embeddings=4096)
    llm = LLM(str(directory), device=device, engine_config=EngineConfig(gpu_memory_utilization=0.1,
                                                                        max_num_seqs=4096, block_size=BLOCK))
    rt = llm.engine.runtime
    total = torch.cuda.mem_get_info()[1]
    assert "profile" in rt.startup_seconds and rt.activation_peak_bytes > 0 and rt.weights_bytes > 0
    assert 0 < rt.kv_cache_bytes <= 0.1 * total - rt.weights_bytes - rt.activation_peak_bytes
    assert llm.generate([PROMPTS[0]], greedy(4))[0].finish_reason == "length"
