"""Tiny random GPT-2 checkpoints built with HF `transformers` (plus a byte-level BPE
`tokenizer.json` built with `tokenizers`), and a one-call full forward pass of our model.

Nothing is downloaded: every model comes from a fixed torch seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from pathlib import Path

import pytest
import torch

from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from torch import nn

EOS_TOKEN = "<|endoftext|>"
# Enough text for a few hundred BPE merges; any fixed text would do.
_CORPUS = [
    "The cat sat on the mat. The dog sat on the log. A bird sang in the tree.",
    "Attention is all you need: queries, keys and values, scaled dot products.",
    "Le chat est sur le tapis. Der Hund liegt auf dem Teppich. 猫はマットの上に座った。",
    "Emoji too: 🙂🚀✨, numbers 0123456789, and punctuation !?;:()[]{}.",
    "She sells sea shells by the sea shore; the shells she sells are sea shells.",
    "In the beginning there was a token, and then another token, and then many more.",
] * 4


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads, as an engine replica with `torch_threads: n` does:
    float32 sums split over another number of threads differ in their last bits, so an offline
    reference for a replica's numbers is computed with the replica's thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Every test of a module that imports this fixture runs on one torch thread. Tiny shapes
    gain nothing from a second one, and on a shared 2-core machine OpenMP's barrier waits made
    such modules several times slower; HF's references and our runs share the thread count, so
    in-process comparisons stay exact."""
    with torch_threads(1):
        yield


def build_tokenizer(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with at most `vocab_size` ids; id 0 is EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= 257, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    return tok


def add_noise(model: nn.Module, names: tuple[str, ...], scale: float = 0.1) -> None:
    """Noise on every bias and on the parameters whose names hold one of `names` (norms: HF
    initialises them to 0 and 1), so a mix-up of any two tensors changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or any(n in name for n in names):
                p.add_(torch.randn_like(p) * scale)


def build_tiny_gpt2(n_layer: int = 2, n_head: int = 2, n_embd: int = 64, vocab_size: int = 301,
                    n_positions: int = 128, seed: int = 0, eos_token_id: int | None = 0):
    """A random `transformers.GPT2LMHeadModel` in eval mode, the same for one seed.

    Biases and LayerNorm parameters get noise too (HF initialises them to 0 and 1), so a
    mix-up of any two tensors changes the logits.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                        n_positions=n_positions, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                        initializer_range=0.1)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    add_noise(model, (".ln_",))
    return model


def save_tiny_gpt2(directory: str | Path, n_layer: int = 2, n_head: int = 2, n_embd: int = 64,
                   vocab_size: int = 301, n_positions: int = 128, seed: int = 0, with_tokenizer: bool = True,
                   sharded: bool = False) -> Path:
    """Save `build_tiny_gpt2(...)` with `save_pretrained` (safetensors) to `directory`.

    `with_tokenizer` adds a `tokenizer.json` (needs vocab_size >= 257); `sharded` splits the
    weights into several files with a `model.safetensors.index.json`.
    """
    directory = Path(directory)
    model = build_tiny_gpt2(n_layer, n_head, n_embd, vocab_size, n_positions, seed)
    model.save_pretrained(directory, max_shard_size="20KB" if sharded else "10GB")
    if with_tokenizer:
        build_tokenizer(vocab_size).save(str(directory / "tokenizer.json"))
    return directory


def full_logits(model: nn.Module, token_ids: list[int] | torch.Tensor, block_size: int = 16,
                rope_len: int = 0) -> torch.Tensor:
    """Our model's logits (T, vocab) for one sequence, prefilled in one pass over a fresh cache
    (`rope_len`: every position rotated as in a sequence of at least that many tokens, as the
    engine rotates a prompt longer than a dynamic/LongRoPE model's original context)."""
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device  # the cache and metadata live where the model does
    tokens = torch.as_tensor(token_ids, dtype=torch.long).to(device)
    t = tokens.shape[0]
    cfg = model.cfg
    num_blocks = math.ceil(t / block_size)
    cache = KVCache(cfg.n_layers, num_blocks, block_size, cfg.kv_heads, cfg.d_head, dtype, device)
    meta = AttnMetadata(slot_mapping=torch.arange(t, device=device), prefills=[
        PrefillChunk(start=0, length=t, context_len=t, block_table=torch.arange(num_blocks, device=device))],
        rope_len=torch.full((t,), rope_len, dtype=torch.long, device=device) if rope_len else None)
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(t, device=device), meta, cache))


# ---- the Llama family ----------------------------------------------------------------

LLAMA_FAMILY = {  # our short name -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_greedy(hf: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt`, never stopping at an EOS (our ignore_eos)."""
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return ref[0, len(prompt):].tolist()


def build_tiny_llama(arch: str = "llama", seed: int = 0, **overrides):
    """A random Llama-family `transformers` model (eval mode, fp32, eager attention), the same
    for one seed. Defaults: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 301, 128 positions,
    untied head; any config field can be overridden (`num_key_value_heads`, `head_dim`,
    `tie_word_embeddings`, `rope_scaling`, `sliding_window`, ...).

    Norm weights and biases get noise too (HF initialises them to 1 and 0), so a mix-up of
    any two tensors changes the logits.
    """
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in LLAMA_FAMILY[arch])
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=301, max_position_embeddings=128, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=0, pad_token_id=None, initializer_range=0.1)
    if arch in ("mistral", "qwen2", "qwen3"):
        fields["sliding_window"] = None
    fields.update(overrides)
    config = config_cls(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    add_noise(model, ("norm",))
    return model


def write_tiny_llama(directory: str | Path, arch: str = "llama", seed: int = 0, dtype: torch.dtype | None = None,
                     max_shard_size: str | None = None, with_tokenizer: bool = True, **overrides) -> Path:
    """Save `build_tiny_llama(arch, seed, **overrides)` with `save_pretrained` to `directory`.

    `dtype` (e.g. torch.bfloat16) converts the weights before saving; `max_shard_size`
    (e.g. "20KB") shards them; `with_tokenizer` adds a byte-level BPE `tokenizer.json`
    whose id 0 is the EOS token (needs vocab_size >= 257).
    """
    directory = Path(directory)
    model = build_tiny_llama(arch, seed, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory, max_shard_size=max_shard_size or "10GB")
    if with_tokenizer:
        build_tokenizer(model.config.vocab_size).save(str(directory / "tokenizer.json"))
    return directory


# ---- mixture of experts (build_tiny_llama / write_tiny_llama build these too) -------------

MOE_FAMILY = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
LLAMA_FAMILY.update(MOE_FAMILY)


# ---- engine parity runs shared by the architecture tests (issue 25) -----------------------

def _other_requests(n: int, vocab: int, seed: int):
    """n requests of up to 40 + 24 tokens, greedy and sampled."""
    import random

    from model import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99),
                             ignore_eos=True) for _ in range(n)]
    return prompts, params


def engine_greedy_runs(directory: str | Path, prompt: list[int], max_tokens: int, vocab: int,
                       block_size: int = 8, preemption_engine: dict | None = None,
                       device: str = "cpu", **engine: Any) -> dict[str, list[int]]:
    """Our greedy continuation of `prompt` (ignore_eos), fp32 on `device` (other EngineConfig
    fields from `engine`), four ways:
    `alone`; `prefix_cache` (the same prompt again, its full blocks found in the prefix cache);
    `batch` (inside 16 other requests, with prompts chunked over steps of 48 tokens);
    `preemption` (with 8 others in a pool too small for all, so some are preempted; the pool
    is `own + 3` blocks unless `preemption_engine` gives other EngineConfig fields: a model
    whose sequences give back out-of-window blocks needs a tighter one).
    Asserts that the cache was hit and that preemption happened."""
    from model import LLM, SamplingParams
    from model.config import EngineConfig

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runs: dict[str, list[int]] = {}
    llm = LLM(str(directory), device=device, dtype="float32", engine_config=EngineConfig(block_size=block_size, **engine))
    runs["alone"] = llm.generate([prompt], greedy)[0].token_ids
    hits = llm.engine.stats().prefix_cache_hits
    runs["prefix_cache"] = llm.generate([prompt], greedy)[0].token_ids
    assert llm.engine.stats().prefix_cache_hits - hits >= (len(prompt) - 1) // block_size * block_size
    others, params = _other_requests(16, vocab, seed=3)
    llm = LLM(str(directory), device=device, dtype="float32",
              engine_config=EngineConfig(block_size=block_size, max_num_batched_tokens=48, **engine))
    outs = llm.generate(others[:8] + [prompt] + others[8:], params[:8] + [greedy] + params[8:])
    runs["batch"] = outs[8].token_ids
    own = math.ceil((len(prompt) + max_tokens) / block_size)
    llm = LLM(str(directory), device=device, dtype="float32",
              engine_config=EngineConfig(**{"num_kv_blocks": own + 3, "block_size": block_size, **engine,
                                             **(preemption_engine or {})}))
    others, params = _other_requests(8, vocab, seed=4)
    outs = llm.generate(others[:4] + [prompt] + others[4:], params[:4] + [greedy] + params[4:])
    assert llm.engine.stats().num_preemptions_total > 0
    runs["preemption"] = outs[4].token_ids
    return runs


# ---- Gemma 2/3 and Phi-3 (build_tiny_llama / write_tiny_llama build these too; pass head_dim,
# query_pre_attn_scalar, sliding_window, ... as overrides) ----------------------------------

LLAMA_FAMILY.update({
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
})
