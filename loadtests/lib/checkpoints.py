"""Random checkpoints of real models' shapes, which the benchmarks run on: Llama-family ones
written without `transformers` (HF-compatible `config.json` + safetensors shards), Qwen3-MoE ones
written by `transformers` (its per-expert tensors, as published MoE checkpoints store them), and
the GPT-2-small preset in the project's own format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.loading.checkpoint import CONFIG_FILE, INDEX_FILE, load_config, save_model
from model.loading.loading import build_preset
from model.models.registry import ARCHITECTURES, build_model

PRESET = "gpt2-small-random"  # the project's GPT-2-small shape with random weights, built in memory

_QWEN25_05B = {  # Qwen/Qwen2.5-0.5B: 494M parameters, GQA 14:2, tied head
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 24, "bos_token_id": 151643, "eos_token_id": 151643,
}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
# HF config.json fields of real models (weights random): the shapes the benchmarks run.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": _QWEN25_05B,
    "gemma3-1b-shape": {  # google/gemma-3-1b-pt (text): 1.0B parameters, MQA 4:1, head_dim 256, 5:1 local/global
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window": 512,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
    "llama3.2-1b-shape": {  # meta-llama/Llama-3.2-1B: 1.24B parameters, GQA 32:8, tied head
        **_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama3.1-8b-shape": {  # meta-llama/Llama-3.1-8B's layers (no RoPE scaling: contexts of a few thousand)
        **_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": 0,
    },
    "tiny-llama-shape": {  # a few MB: smoke runs of the benchmarks
        **_LLAMA, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
    # tied like Qwen2.5, with widths that groups of 128 divide (the tiny Llama shape's 344 does not)
    "tiny-qwen-shape": {**_QWEN25_05B, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                        "max_position_embeddings": 2048, "max_window_layers": 2, "bos_token_id": 1, "eos_token_id": 2},
}
SHARD_BYTES = 512 << 20

_MOE_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, norm_topk_prob=True,
                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None,
                   use_sliding_window=False)
MOE_SHAPES: dict[str, dict[str, Any]] = {  # Qwen3MoeConfig fields
    "qwen3-moe-1b-shape": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                               head_dim=64, intermediate_size=3072, moe_intermediate_size=256, num_experts=64,
                               num_experts_per_tok=8, vocab_size=151936),
    "tiny-moe-shape": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                           num_experts_per_tok=2, vocab_size=1000),
}


def _random_tensor(shape: torch.Size, name: str, gen: torch.Generator, dtype: torch.dtype,
                   device: str) -> torch.Tensor:
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype).cpu()


def write_random_checkpoint(directory: str | Path, shape: str, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0, device: str = "cpu") -> Path:
    """Write `SHAPES[shape]` with random weights (normal, std 0.02; norms 1) in `dtype`,
    in shards of at most 512 MiB with a `model.safetensors.index.json`; the weights are drawn
    on `device` (a GPU draws an 8B shape in seconds)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = {**SHAPES[shape], "dtype": str(dtype).removeprefix("torch.")}
    (directory / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", "utf-8")
    cfg = load_config(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    names = ARCHITECTURES[raw["architectures"][0]].name_map(model, [])
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for ours, param in model.named_parameters():
        if size > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][names[ours].name] = _random_tensor(param.shape, ours, gen, dtype, device)
        size += param.numel() * shards[-1][names[ours].name].element_size()
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2), "utf-8")
    return directory


def write_moe_checkpoint(directory: Path, shape: str) -> None:
    """A random `Qwen3MoeForCausalLM` of `MOE_SHAPES[shape]`, initialised in bf16 and saved with
    save_pretrained."""
    import transformers

    config = transformers.Qwen3MoeConfig(**_MOE_COMMON, **MOE_SHAPES[shape])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(directory, max_shard_size="1GB")


def checkpoint(model: str, directory: str) -> None:
    """The benchmark weights `model` written to `directory`: the GPT-2 preset, a mixture-of-experts
    shape, or a random Llama-family checkpoint of a real model's shape (bf16 on disk)."""
    if model == PRESET:
        save_model(build_preset(PRESET), directory)
    elif model in MOE_SHAPES:
        write_moe_checkpoint(Path(directory), model)
    else:
        write_random_checkpoint(directory, model, torch.bfloat16)
