"""Llama-family checkpoints saved by HF transformers give HF's logits and greedy continuations,
alone, inside a batch of other requests, and under forced preemption.

Tiny random Llama, Mistral, Qwen2 and Qwen3 models between them cover grouped-query and
plain multi-head attention, tied and untied heads, llama3 and linear RoPE scaling, Qwen2's
q/k/v biases, Qwen3's q/k norms with head_dim != hidden / heads, and a bf16 sharded save.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig, ModelConfig
from model.engine.builder import build_engine
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.loading.checkpoint import CheckpointError, load_model
from tests.support.tiny_models import full_logits, hf_greedy, write_tiny_llama
from tests.support.requirements import need_module

transformers = need_module("transformers")

LOGITS_ATOL = 1e-4  # fp32; the observed difference is ~2e-6
GREEDY_TOKENS = 32
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# id -> (arch, save dtype, sharded, config overrides)
CASES = {
    "llama-gqa-untied-llama3rope": ("llama", None, False, {"rope_scaling": LLAMA3_ROPE}),
    "mistral-mha-tied-linearrope": ("mistral", None, False, {
        "num_key_value_heads": 4, "tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-gqa1-bias-tied-window-off": ("qwen2", None, False, {
        "num_key_value_heads": 1, "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 8}),
    "qwen3-qknorm-headdim32-bf16-sharded": ("qwen3", torch.bfloat16, True, {"head_dim": 32, "num_hidden_layers": 3}),
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory) -> tuple[Path, "transformers.PreTrainedModel", list[int], list[int]]:
    """A saved checkpoint, HF's model loaded back from it in fp32, a prompt and HF's greedy
    continuation of it."""
    arch, dtype, sharded, overrides = CASES[request.param]
    directory = write_tiny_llama(tmp_path_factory.mktemp(arch), arch, seed=len(request.param), dtype=dtype,
                                 max_shard_size="40KB" if sharded else None, **overrides)
    if sharded:
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    hf_cls = getattr(transformers, HF_CLASSES[arch])
    hf = hf_cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = torch.randint(0, hf.config.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_greedy(hf, prompt, GREEDY_TOKENS)
    assert len(expected) == GREEDY_TOKENS
    return directory, hf, prompt, expected


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def test_config_is_read_from_config_json(case) -> None:
    directory, hf, _, _ = case
    cfg, model = load_model(directory)
    c = hf.config
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_head) == (
        "llama", c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, _head_dim(c))
    assert cfg.tie_word_embeddings == c.tie_word_embeddings == (model.lm_head is None)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # bf16 on disk, float32 on the CPU


def test_logits_match_hf(case) -> None:
    directory, hf, _, _ = case
    _, model = load_model(directory)
    tokens = torch.randint(0, hf.config.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]  # (T, vocab)
    got = full_logits(model, tokens, block_size=8)
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


def _greedy(n: int = GREEDY_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _others(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n requests of up to 40 + 24 tokens, greedy and sampled."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99),
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_greedy_continuation_matches_hf_alone(case) -> None:
    directory, _, prompt, expected = case
    llm = LLM(str(directory), device="cpu", dtype="float32")
    assert llm.generate([prompt], _greedy())[0].token_ids == expected


def test_greedy_continuation_matches_hf_in_a_batch_of_16(case) -> None:
    directory, hf, prompt, expected = case
    llm = LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(block_size=8))
    prompts, params = _others(16, hf.config.vocab_size, seed=3)
    outs = llm.generate(prompts[:8] + [prompt] + prompts[8:], params[:8] + [_greedy()] + params[8:])
    assert outs[8].token_ids == expected


def test_greedy_continuation_matches_hf_under_preemption(case) -> None:
    directory, hf, prompt, expected = case
    # 10 blocks of 8 tokens cannot hold 9 sequences of up to 64 tokens: preemption is forced.
    llm = LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(num_kv_blocks=10, block_size=8))
    prompts, params = _others(8, hf.config.vocab_size, seed=4)
    outs = llm.generate(prompts[:4] + [prompt] + prompts[4:], params[:4] + [_greedy()] + params[4:])
    assert llm.engine.stats().num_preemptions_total > 0
    assert outs[4].token_ids == expected


def test_kv_cache_is_sized_by_kv_heads(case) -> None:
    directory, hf, _, _ = case
    engine = build_engine(str(directory), EngineConfig(kv_cache_memory_bytes=1 << 20, max_num_seqs=1000), device="cpu")
    c = hf.config
    assert tuple(engine.runner.cache.keys[0].shape[2:]) == (c.num_key_value_heads, _head_dim(c))
    per_block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * _head_dim(c) * 4  # K and V, fp32
    assert engine.runtime.num_kv_blocks == (1 << 20) // per_block


# ---- what is refused ------------------------------------------------------------------


def _edit_config(directory: Path, **changes) -> None:
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    (directory / "config.json").write_text(json.dumps(raw))


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "llama", "llama", with_tokenizer=False)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_scaling_type_is_named(llama_dir: Path, key: str) -> None:
    _edit_config(llama_dir, **{"rope_parameters": None, key: {"rope_type": "made_up", "factor": 4.0}})
    with pytest.raises(CheckpointError, match=r"rope_scaling type 'made_up' is not supported; supported: .*longrope"):
        load_model(llama_dir)


def test_rope_scaling_in_the_old_place_is_read(llama_dir: Path) -> None:
    """transformers 4.x wrote `rope_theta` and `rope_scaling` ({"type": ...}) at the top level."""
    _edit_config(llama_dir, rope_parameters=None, rope_theta=500000.0,
                 rope_scaling={"type": "linear", "factor": 4.0})
    cfg, _ = load_model(llama_dir)
    assert cfg.rope_theta == 500000.0
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 4.0)


def test_sliding_window_shorter_than_the_context_is_served(tmp_path: Path) -> None:
    """Exactness with windows is tests/model/loading/test_sliding_window.py's; here: no refusal, full context."""
    directory = write_tiny_llama(tmp_path, "mistral", with_tokenizer=False, sliding_window=64)
    engine = build_engine(str(directory), EngineConfig(kv_cache_memory_bytes=1 << 20), device="cpu")
    assert engine.runtime.max_model_len == 128
    assert [engine.model_config.layer_window(i) for i in range(2)] == [64, 64]


def test_context_limit_is_max_position_embeddings(llama_dir: Path) -> None:
    engine = build_engine(str(llama_dir), EngineConfig(kv_cache_memory_bytes=1 << 20), device="cpu")
    assert engine.runtime.max_model_len == 128
    with pytest.raises(ValueError, match="maximum context length is 128"):
        engine.add_request("r", [1] * 100, SamplingParams(max_tokens=29))


def test_other_activation_is_refused(llama_dir: Path) -> None:
    _edit_config(llama_dir, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act must be silu, got 'gelu'"):
        load_model(llama_dir)


def test_mis_shaped_kv_projection_is_named(llama_dir: Path) -> None:
    _edit_config(llama_dir, num_key_value_heads=4)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape \[32, 64\], "
                                              r"expected \[64, 64\]"):
        load_model(llama_dir)


def test_additive_attention_is_refused_with_gqa_or_rope() -> None:
    with pytest.raises(ValueError, match="additive attention is only available"):
        ModelConfig(attention="additive", n_kv_heads=2)
    with pytest.raises(ValueError, match="additive attention is only available"):
        ModelConfig(attention="additive", arch="llama")


# ---- the decode-kernel seam -----------------------------------------------------------


def _loop_kernel(calls: list[int]):
    """A decode kernel written as a plain loop (GQA by repeating K/V heads), with the fused
    kernels' signature; counts its calls."""

    def kernel(q, k_cache, v_cache, block_tables, context_lens, scale, window=None):
        calls.append(1)
        outs = []
        for b in range(q.shape[0]):
            n = int(context_lens[b])
            lo = 0 if window is None else max(0, n - window)
            k = k_cache[block_tables[b]].flatten(0, 1)[lo:n]  # (n - lo, Hkv, d)
            v = v_cache[block_tables[b]].flatten(0, 1)[lo:n]
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (n, Hq, d)
            probs = (torch.einsum("hd,nhd->hn", q[b], k) * scale).softmax(-1)  # (Hq, n)
            outs.append(torch.einsum("hn,nhd->hd", probs, v))
        return torch.stack(outs)  # (B, Hq, d)

    return kernel


@torch.no_grad()
def test_decode_kernel_in_the_metadata_replaces_the_gather_path(tmp_path: Path) -> None:
    directory = write_tiny_llama(tmp_path, "llama", with_tokenizer=False)
    cfg, model = load_model(directory)
    bs, n = 4, 11
    tokens = torch.randint(0, cfg.vocab_size, (n + 1,), generator=torch.Generator().manual_seed(5))
    table = torch.tensor([3, 0, 5, 1], dtype=torch.long)  # scattered blocks

    def decode_logits(kernel) -> torch.Tensor:
        cache = KVCache(cfg.n_layers, 6, bs, cfg.kv_heads, cfg.d_head, torch.float32, "cpu")
        pos = torch.arange(n)
        model(tokens[:n], pos, AttnMetadata(slot_mapping=table[pos // bs] * bs + pos % bs,
                                            prefills=[PrefillChunk(0, n, n, table)]), cache)
        meta = AttnMetadata(slot_mapping=(table[n // bs] * bs + n % bs).view(1), num_decode=1,
                            decode_block_tables=table[None], decode_context_lens=torch.tensor([n + 1]),
                            decode_max_context=n + 1, decode_kernel=kernel)
        return model.compute_logits(model(tokens[n:], torch.tensor([n]), meta, cache))

    calls: list[int] = []
    torch.testing.assert_close(decode_logits(_loop_kernel(calls)), decode_logits(None), atol=1e-5, rtol=0)
    assert len(calls) == cfg.n_layers


def test_auto_dtype_follows_a_16_bit_checkpoint_on_cuda() -> None:
    from model.loading.loading import resolve_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda, torch.float16) == torch.float16
    assert resolve_dtype("auto", cuda, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", cuda, torch.float32) == torch.bfloat16  # as vLLM: no fp32 serving by default
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.float32
    assert resolve_dtype("float16", cpu, torch.bfloat16) == torch.float16
