"""Gemma 2 and Gemma 3 (text): the Llama-shaped decoder with Gemma's differences.

- every RMSNorm is Gemma's (1 + weight) form, and each sub-layer has a norm before and after
  it (input/post_attention around attention, pre/post_feedforward around the MLP);
- token embeddings are multiplied by sqrt(d_model), rounded to the model's dtype;
- the MLP is GeGLU with the tanh GELU;
- attention scores are scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps them
  (tanh(s / cap) * cap) and the final logits too;
- layers alternate sliding-window and global attention (`layer_types`: Gemma 2 every other
  layer, Gemma 3 five local to one global), and Gemma 3's local layers use their own unscaled
  RoPE base; Gemma 3 also normalises each head of q and k.

Parameter names are HF's without the `model.` prefix, as for the Llama family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from model.config import GemmaOptions, ModelConfig
from model.layers.attention import DotScore, PagedAttention
from model.layers.kv_cache import AttnMetadata, KVCache
from model.layers.linear.dense import linear
from model.layers.mlp import GatedMLP
from model.layers.norms import GemmaRMSNorm
from model.layers.positions import RotaryEmbedding
from model.models.llama import LlamaAttention, RopeTables, _name_map, _rope, _skip, context_length, layer_types
from model.models.weight_map import ArchitectureSpec, CheckpointError

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
SLIDING = "sliding_attention"


class GemmaAttention(LlamaAttention):
    """Llama's projections and RoPE; Gemma's scale, soft-cap, window and (Gemma 3) q/k norms."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        g = cfg.gemma
        assert g is not None
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.d_head, cfg.layer_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.d_head, cfg.layer_norm_eps)
        self.attn = PagedAttention(layer, cfg.d_head, DotScore(cfg.d_head, scale=g.query_pre_attn_scalar**-0.5),
                                   window=cfg.layer_window(layer), softcap=g.attn_logit_softcapping)


class GemmaDecoderLayer(nn.Module):
    """x + post_norm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = cfg.layer_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.d_model, eps)
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.d_model, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.d_model, eps)
        self.mlp = GatedMLP(cfg, activation="gelu_tanh")
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.d_model, eps)

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text: token ids + positions (flattened over the batch) -> hidden -> logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.gemma is not None
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = GemmaRMSNorm(cfg.d_model, cfg.layer_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
        local = cfg.gemma.rope_local_theta
        self.rotary_local = None if local is None else RotaryEmbedding(cfg.d_head, local, None)
        # Which layers read the local RoPE tables (Gemma 3's sliding layers).
        self.local_layers = frozenset() if local is None else frozenset(
            i for i, kind in enumerate(cfg.layer_types or ()) if kind == SLIDING)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                cache: KVCache) -> torch.Tensor:
        """tokens, positions: (T,) long -> hidden (T, d_model)."""
        x = self.embed_tokens(tokens)
        x = x * torch.tensor(self.cfg.d_model**0.5, dtype=x.dtype)  # HF rounds the normaliser to the dtype
        rope = self.rotary.cos_sin(positions, x.dtype)
        rope_local = self.rotary_local.cos_sin(positions, x.dtype) if self.rotary_local is not None else None
        for i, layer in enumerate(self.layers):
            x = layer(x, rope_local if i in self.local_layers else rope, meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) -> (N, vocab), soft-capped when the config says so (Gemma 2)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.finish_logits(linear(hidden, weight))

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What follows the head's product: Gemma 2's final-logit soft-cap (none: as is). A
        quantized head (model/loading/quant/quantize.py) applies it after its own product."""
        cap = self.cfg.gemma.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- config.json ------------------------------------------------------------------------


def _gemma_rope(raw: dict[str, Any], version: int) -> tuple[float, Any, float | None]:
    """(global theta, global scaling, local theta): Gemma 3's rope_parameters hold one set per
    layer type (older configs: rope_theta, rope_scaling and rope_local_base_freq)."""
    if version == 2:
        return (*_rope(raw), None)
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": 1_000_000.0, **(params.get("full_attention") or {})}
        local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
    else:
        full = {"rope_theta": raw.get("rope_theta", 1_000_000.0), **(raw.get("rope_scaling") or {})}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    local_theta, local_scaling = _rope(raw, local)
    if local_scaling is not None:
        raise CheckpointError(f"Gemma 3's sliding layers use unscaled RoPE; got {local_scaling.kind!r} for them")
    return (*_rope(raw, full), local_theta)


def _layer_types(raw: dict[str, Any], version: int, window: int | None) -> tuple[str, ...] | None:
    """`layer_types`, or HF's default: Gemma 2 alternates (layer 0 sliding), Gemma 3 makes every
    `sliding_window_pattern`-th layer global (default 6)."""
    if window is None:
        return None
    if raw.get("layer_types"):
        return layer_types(raw, window)
    pattern = 2 if version == 2 else int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return tuple(SLIDING if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"]))


def _parser(version: int):
    def parse(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
        if "text_config" in raw:
            raise CheckpointError("a multimodal Gemma 3 checkpoint (text_config): only the text-only "
                                  "Gemma3ForCausalLM (model_type gemma3_text) is supported")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GELU_TANH:
            raise CheckpointError(f"hidden_activation must be one of {', '.join(GELU_TANH)}, got {act!r}")
        theta, scaling, local_theta = _gemma_rope(raw, version)
        window = raw.get("sliding_window")
        window = None if window is None else int(window)
        heads = raw["num_attention_heads"]
        bias = bool(raw.get("attention_bias", False))
        gemma = GemmaOptions(
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            final_logit_softcapping=raw.get("final_logit_softcapping"), rope_local_theta=local_theta)
        return ModelConfig(
            vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_heads=heads,
            n_layers=raw["num_hidden_layers"], d_ff=raw["intermediate_size"],
            max_position=context_length(raw, scaling), arch=f"gemma{version}",
            layer_norm_eps=raw.get("rms_norm_eps", 1e-6), tokenizer="hf" if has_tokenizer else "byte",
            n_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim"), rope_theta=theta,
            rope_scaling=scaling, qkv_bias=bias, out_bias=bias, qk_norm=version == 3,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), sliding_window=window,
            layer_types=_layer_types(raw, version, window), gemma=gemma)

    return parse


GEMMA_FAMILY = {
    "Gemma2ForCausalLM": ArchitectureSpec(parse_config=_parser(2), name_map=_name_map, skip=_skip),
    "Gemma3ForCausalLM": ArchitectureSpec(parse_config=_parser(3), name_map=_name_map, skip=_skip),
}
