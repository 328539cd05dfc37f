"""The `config.json` fields (those the registry's parsers read) of a few widely served checkpoints:
what the docs' memory table is computed from (docs/generate.py) and what the start-up sizing is
tested against, with no download. Values as published on each model's hub page."""

from __future__ import annotations

from typing import Any

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001,
            "attention_bias": False, "mlp_bias": False}
_QWEN = {"hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "use_sliding_window": False, "sliding_window": None}

REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-7B-Instruct": {
        **_QWEN, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "max_window_layers": 28, "vocab_size": 152064,
        "bos_token_id": 151643, "eos_token_id": 151645},
    "meta-llama/Llama-3.1-8B": {
        **_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32},
    "Qwen/Qwen3-8B": {
        **_QWEN, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "max_window_layers": 36, "vocab_size": 151936,
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "meta-llama/Llama-3.1-70B": {
        **_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64},
}
