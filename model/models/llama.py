"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm).

Pre-RMSNorm blocks, rotary positions, SwiGLU MLP, grouped-query attention over the paged
cache (K/V stored with `n_kv_heads` heads), tied or untied LM head. Parameter names are HF's
without the `model.` prefix, so the weight-name map is nearly the identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from model.config import ROPE_SCALING_TYPES, ModelConfig, RopeScaling
from model.layers.attention import DotScore, PagedAttention
from model.layers.kv_cache import AttnMetadata, KVCache
from model.layers.linear.dense import Linear, linear
from model.layers.linear.fuse import fuse_parts
from model.layers.mlp import GatedMLP
from model.layers.norms import RMSNorm
from model.layers.positions import RotaryEmbedding
from model.layers.vision import merge_image_embeds
from model.models.weight_map import ArchitectureSpec, CheckpointError, TensorSpec, identity_map

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: (T, 1, head_dim) each


def rotary_dim(cfg: ModelConfig) -> int:
    """The dims of each head that RoPE rotates: int(d_head * partial_rotary_factor), as HF."""
    return int(cfg.d_head * cfg.partial_rotary_factor)


class LlamaAttention(nn.Module):
    """q/k/v projections (Hq and Hkv heads of head_dim), optional q/k norms, RoPE, paged attention.

    Loaded with HF's `q_proj`, `k_proj` and `v_proj`; `fuse_projections` makes them one
    `qkv_proj` (rows: q, then k, then v), the layout Phi-3's checkpoints store."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_head = cfg.n_heads, cfg.kv_heads, cfg.d_head
        self.q_proj = Linear(cfg.d_model, cfg.n_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.d_model, cfg.kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.d_model, cfg.kv_heads * cfg.d_head, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.d_head, cfg.d_model, bias=cfg.out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.d_head, cfg.layer_norm_eps)
            self.k_norm = RMSNorm(cfg.d_head, cfg.layer_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.sinks = nn.Parameter(torch.empty(cfg.n_heads)) if cfg.attention_sinks else None  # gpt-oss
        self.attn = PagedAttention(layer, cfg.d_head, DotScore(cfg.d_head), window=cfg.layer_window(layer))
        self.fused = False

    def fuse_projections(self) -> bool:
        """q, k and v as one product (model/layers/linear/fuse.py); False when they cannot be."""
        return fuse_parts(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, d_model) -> q (T, Hq, d), k and v (T, Hkv, d)."""
        t, hq, hkv, d = x.shape[0], self.n_heads, self.n_kv, self.d_head
        if self.fused:
            q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
            return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        return self.q_proj(x).view(t, hq, d), self.k_proj(x).view(t, hkv, d), self.v_proj(x).view(t, hkv, d)

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        """x (T, d_model) -> (T, d_model)."""
        t = x.shape[0]
        q, k, v = self.project(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, *rope), RotaryEmbedding.apply(k, *rope)
        out = self.attn(q, k, v, meta, cache, sinks=self.sinks)  # (T, Hq, d)
        return self.o_proj(out.reshape(t, self.n_heads * self.d_head))


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        self.mlp = GatedMLP(cfg) if mlp is None else mlp  # another feed-forward: the MoE families

    def forward(self, x: torch.Tensor, rope: RopeTables, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Token ids + positions (flattened over the batch) -> hidden states -> logits."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[ModelConfig, int], nn.Module] | None = None) -> None:
        """`make_mlp(cfg, layer)`: each layer's feed-forward instead of SwiGLU (the MoE families)."""
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, None if make_mlp is None else make_mlp(cfg, i))
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.layer_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.d_head, cfg.rope_theta, cfg.rope_scaling, rotary_dim(cfg))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                cache: KVCache) -> torch.Tensor:
        """tokens, positions: (T,) long -> hidden (T, d_model); a vision model's image placeholder
        rows take their image's embeddings (`meta.mm_embeds`)."""
        x = merge_image_embeds(self.embed_tokens(tokens), meta)
        rope = self.rope_tables(positions, x.dtype, meta)  # shared by every layer
        for layer in self.layers:
            x = layer(x, rope, meta, cache)
        return self.norm(x)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttnMetadata) -> RopeTables:
        """cos, sin of the step's rows (Qwen2-VL's M-RoPE overrides this)."""
        return self.rotary.cos_sin(positions, dtype, meta.rope_len)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) -> (N, vocab)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)


# ---- config.json and weight names -------------------------------------------------------

DEFAULT_ROPE_TYPES = (None, "default")


ROPE_TYPE_ALIASES = {"su": "longrope"}  # what transformers 4.x configs of Phi-3 call it


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters: `rope_parameters` (transformers 5) or the older `rope_scaling`."""
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope(raw: dict[str, Any], params: dict[str, Any] | None = None) -> tuple[float, RopeScaling | None]:
    """rope_theta and rope_scaling, from `params` (default: `rope_parameters`, transformers 5,
    or the older top-level `rope_theta` + `rope_scaling`); read as modeling_rope_utils does."""
    params = rope_params(raw) if params is None else params
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type"))
    kind = ROPE_TYPE_ALIASES.get(kind, kind)
    if kind in DEFAULT_ROPE_TYPES:
        return theta, None
    if kind not in ROPE_SCALING_TYPES:
        raise CheckpointError(f"rope_scaling type {kind!r} is not supported; supported: default, "
                              f"{', '.join(ROPE_SCALING_TYPES)}")
    max_position = raw.get("max_position_embeddings", 8192)
    original = int(params.get("original_max_position_embeddings")
                   or raw.get("original_max_position_embeddings") or max_position)
    if kind == "dynamic":  # HF's dynamic NTK counts from max_position_embeddings itself
        original = max_position
    factor = params.get("factor")
    if factor is None:
        if kind not in ("yarn", "longrope"):
            raise CheckpointError(f"rope_scaling type {kind!r} needs a factor")
        factor = max_position / original
    beta_fast, beta_slow = params.get("beta_fast"), params.get("beta_slow")
    try:
        scaling = RopeScaling(
            kind=kind, factor=float(factor), low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)), original_max_position=original,
            attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"), beta_fast=float(beta_fast or 32),
            beta_slow=float(beta_slow or 1), truncate=bool(params.get("truncate", True)),
            short_factor=params.get("short_factor"), long_factor=params.get("long_factor"))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc
    return theta, scaling


def context_length(raw: dict[str, Any], scaling: RopeScaling | None) -> int:
    """The longest context served: max_position_embeddings, except for the scalings that extend
    it (as vLLM derives it): `dynamic` NTK's max_position_embeddings * factor, and YaRN's
    original_max_position_embeddings * factor when that is longer."""
    max_position = int(raw.get("max_position_embeddings", 2048))
    if scaling is not None and scaling.kind == "dynamic":
        return int(max_position * scaling.factor)
    if scaling is not None and scaling.kind == "yarn":
        return max(max_position, int(scaling.original_max_position * scaling.factor))
    return max_position


def partial_rotary_factor(raw: dict[str, Any]) -> float:
    """The fraction of each head's dims that RoPE rotates (Phi-3/4's `partial_rotary_factor`)."""
    params = rope_params(raw)
    inner = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(inner if inner is not None else raw.get("partial_rotary_factor", 1.0))


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window, or None when every layer sees the whole context
    (Qwen's `use_sliding_window: false` switches a configured window off)."""
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", True):
        return None
    return int(window)


def layer_types(raw: dict[str, Any], window: int | None) -> tuple[str, ...] | None:
    """Which layers have the sliding window: config.json's `layer_types`, or (older Qwen2/3
    configs) the layers from `max_window_layers` on; None: all of them (Mistral)."""
    if window is None:
        return None
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    if "max_window_layers" in raw:
        first = int(raw["max_window_layers"])
        return tuple("sliding_attention" if i >= first else "full_attention"
                     for i in range(raw["num_hidden_layers"]))
    return None


def _parser(qkv_bias: bool | None, qk_norm: bool) -> Callable[[dict[str, Any], bool], ModelConfig]:
    """A config.json parser for one family member; `qkv_bias` None: from `attention_bias`."""

    def parse(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act must be silu, got {raw['hidden_act']!r}")
        theta, scaling = _rope(raw)
        window = _sliding_window(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        heads = raw["num_attention_heads"]
        return ModelConfig(
            vocab_size=raw["vocab_size"], d_model=raw["hidden_size"], n_heads=heads,
            n_layers=raw["num_hidden_layers"], d_ff=raw["intermediate_size"],
            max_position=context_length(raw, scaling), arch="llama",
            layer_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tokenizer="hf" if has_tokenizer else "byte", n_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim"), rope_theta=theta, rope_scaling=scaling,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias, out_bias=attention_bias and qkv_bias is None,
            mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), sliding_window=window,
            layer_types=layer_types(raw, window), partial_rotary_factor=partial_rotary_factor(raw))

    return parse


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    """HF keeps the decoder under `model.` and the head as `lm_head.weight`; a headless
    `*Model` checkpoint (what sentence-transformers saves) has the decoder's names bare."""
    names = identity_map(model, prefix="" if "embed_tokens.weight" in tensor_names else "model.")
    if "lm_head.weight" in names:
        names["lm_head.weight"] = TensorSpec("lm_head.weight")
    return names


def _skip(cfg: ModelConfig, name: str) -> bool:
    """Rotary tables some checkpoints saved, and a stored copy of a tied head."""
    return name.endswith(".rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _spec(qkv_bias: bool | None, qk_norm: bool = False, headless: bool = False) -> ArchitectureSpec:
    """`headless`: a `*Model` checkpoint without `lm_head` (an embedding model); its logits, if it
    is asked to generate, come from the tied token embedding."""
    parse = _parser(qkv_bias, qk_norm)
    if headless:
        parse = _tied(parse)
    return ArchitectureSpec(parse_config=parse, name_map=_name_map, skip=_skip)


def _tied(parse: Callable[[dict[str, Any], bool], ModelConfig]) -> Callable[[dict[str, Any], bool], ModelConfig]:
    def parse_tied(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
        return dataclasses.replace(parse(raw, has_tokenizer), tie_word_embeddings=True)
    return parse_tied


LLAMA_FAMILY = {
    "LlamaForCausalLM": _spec(qkv_bias=None),
    "MistralForCausalLM": _spec(qkv_bias=None),
    "Qwen2ForCausalLM": _spec(qkv_bias=True),
    "Qwen3ForCausalLM": _spec(qkv_bias=None, qk_norm=True),
    # Headless checkpoints (sentence-transformers' embedding models): decoder only, no lm_head.
    "LlamaModel": _spec(qkv_bias=None, headless=True),
    "MistralModel": _spec(qkv_bias=None, headless=True),
    "Qwen2Model": _spec(qkv_bias=True, headless=True),
    "Qwen3Model": _spec(qkv_bias=None, qk_norm=True, headless=True),
}
