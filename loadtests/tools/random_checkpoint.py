"""Random Llama-family checkpoints of real models' shapes, written without `transformers`
(HF-compatible `config.json` + safetensors shards), for benchmarks and memory measurements.

    .venv/bin/python loadtests/tools/random_checkpoint.py /tmp/qwen-shape [--shape qwen2.5-0.5b-shape] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.loading.checkpoint import CONFIG_FILE, INDEX_FILE, load_config  # noqa: E402
from model.models.registry import ARCHITECTURES, build_model  # noqa: E402

# HF config.json fields of real models (weights random): the shapes the benchmarks run.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-shape": {  # Qwen/Qwen2.5-0.5B: 494M parameters, GQA 14:2, tied head
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 24, "bos_token_id": 151643, "eos_token_id": 151643,
    },
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
    "tiny-llama-shape": {  # a few MB: smoke runs of the benchmark
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    },
}
SHARD_BYTES = 512 << 20


def _random_tensor(shape: torch.Size, name: str, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if "norm" in name:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_random_checkpoint(directory: str | Path, shape: str, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0) -> Path:
    """Write `SHAPES[shape]` with random weights (normal, std 0.02; norms 1) in `dtype`,
    in shards of at most 512 MiB with a `model.safetensors.index.json`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = {**SHAPES[shape], "dtype": str(dtype).removeprefix("torch.")}
    (directory / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", "utf-8")
    cfg = load_config(directory)
    with torch.device("meta"):
        model = build_model(cfg)
    names = ARCHITECTURES[raw["architectures"][0]].name_map(model, [])
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for ours, param in model.named_parameters():
        if size > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][names[ours].name] = _random_tensor(param.shape, ours, gen, dtype)
        size += param.numel() * shards[-1][names[ours].name].element_size()
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2), "utf-8")
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    ap.add_argument("--shape", default="qwen2.5-0.5b-shape", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_random_checkpoint(args.directory, args.shape, getattr(torch, args.dtype), args.seed)
    print(f"wrote {args.directory}")


if __name__ == "__main__":
    main()
