"""GPT-2 (`GPT2LMHeadModel`, `GPT2Model`): the paper's decoder with pre-LayerNorm, learned
positions, GELU and a tied LM head, run by `model.models.transformer.Transformer(arch="gpt2")`.

Its Conv1D weights are stored (in, out), so they are transposed into our `nn.Linear`
(out, in). Keys carry a `transformer.` prefix in GPT2LMHeadModel checkpoints, none in GPT2Model's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig
from model.models.weight_map import ArchitectureSpec, CheckpointError, TensorSource, TensorSpec

logger = logging.getLogger(__name__)

# Both are GELU's tanh approximation, which is what our gpt2 arch computes.
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Causal-mask buffers that old GPT-2 checkpoints saved; they are not weights.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_LM_HEAD = "lm_head.weight"
_CONV1D = {"attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}


def gpt2_name_map(n_layers: int, prefix: str) -> dict[str, TensorSpec]:
    """Our parameter names -> GPT-2's (`prefix` is "transformer." for GPT2LMHeadModel keys)."""
    names = {ours: TensorSpec(prefix + ours) for ours in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")}
    for i in range(n_layers):
        for ln in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ln}.{kind}"] = TensorSpec(f"{prefix}h.{i}.{ln}.{kind}")
        for ours, theirs in _CONV1D.items():
            names[f"blocks.{i}.{ours}.weight"] = TensorSpec(f"{prefix}h.{i}.{theirs}.weight", transpose=True)
            names[f"blocks.{i}.{ours}.bias"] = TensorSpec(f"{prefix}h.{i}.{theirs}.bias")
    return names


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    prefix = "transformer." if "transformer.wte.weight" in tensor_names else ""
    return gpt2_name_map(model.cfg.n_layers, prefix)


def parse_gpt2_config(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    """GPT-2's config.json fields (HF defaults where absent) -> ModelConfig(arch="gpt2")."""
    activation = raw.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise CheckpointError(f"activation_function must be one of {', '.join(GPT2_ACTIVATIONS)}, got {activation!r}")
    for flag, allowed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if raw.get(flag, allowed) != allowed:
            raise CheckpointError(f"{flag} must be {allowed} for GPT-2 checkpoints, got {raw[flag]!r}")
    d_model, vocab = raw.get("n_embd", 768), raw.get("vocab_size", 50257)
    return ModelConfig(
        vocab_size=vocab, d_model=d_model, n_heads=raw.get("n_head", 12), n_layers=raw.get("n_layer", 12),
        d_ff=raw.get("n_inner") or 4 * d_model, max_position=raw.get("n_positions", 1024), attention="dot",
        arch="gpt2", layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tokenizer="hf" if has_tokenizer else "byte",
    )


def _skip(cfg: ModelConfig, name: str) -> bool:
    """Old mask buffers, and a stored LM head (checked against the embedding by `_verify`)."""
    return name.endswith(_BUFFER_SUFFIXES) or name == _LM_HEAD


def _verify(model: nn.Module, index: TensorSource, where: str) -> None:
    """A stored LM head must equal the token embedding: only tied heads are supported."""
    if _LM_HEAD not in index:
        return
    wte = model.wte.weight
    lm_head = index.get_tensor(_LM_HEAD).to(wte)
    if lm_head.shape != wte.shape or not torch.equal(lm_head, wte):
        raise CheckpointError(f"{_LM_HEAD} in {where} differs from the token embedding: "
                              "only tied LM heads are supported")


def gpt2_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """config.json as `GPT2LMHeadModel.from_pretrained` reads it."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_inner": cfg.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "tie_word_embeddings": True,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    }


GPT2 = ArchitectureSpec(parse_config=parse_gpt2_config, name_map=_name_map, skip=_skip, verify=_verify,
                        config_json=gpt2_config_json)
