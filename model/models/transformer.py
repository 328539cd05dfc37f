"""The decoder-only Transformer: embeddings, N blocks (attention + position-wise FFN), LM head.

`arch="transformer"` is the paper's layer (post-LayerNorm, sinusoidal positions, ReLU,
embeddings scaled by sqrt(d_model) and shared with the output layer). `arch="gpt2"` is
GPT-2's (pre-LayerNorm, learned positions, GELU, final LayerNorm, tied LM head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig
from model.layers.attention import MultiHeadAttention
from model.layers.kv_cache import AttnMetadata, KVCache
from model.layers.linear.dense import linear
from model.layers.mlp import FeedForward
from model.layers.positions import PerDevice, sinusoidal_table
from model.models.weight_map import ArchitectureSpec, identity_map


class Block(nn.Module):
    """One layer: attention and FFN sub-layers, each with a residual connection and LayerNorm."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = MultiHeadAttention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, meta: AttnMetadata | None, cache: KVCache | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.ln_1(x), meta, cache)
            return x + self.mlp(self.ln_2(x))
        # The paper: LayerNorm(x + Sublayer(x)).
        x = self.ln_1(x + self.attn(x, meta, cache))
        return self.ln_2(x + self.mlp(x))


class Transformer(nn.Module):
    """Token ids + positions (flattened over the batch) -> hidden states -> logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.learned_positions:
            self.wpe = nn.Embedding(cfg.max_position, cfg.d_model)
        else:
            self._pe = PerDevice(sinusoidal_table(cfg.max_position, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.pre_norm else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata | None,
                cache: KVCache | None) -> torch.Tensor:
        """tokens, positions: (T,) long -> hidden (T, d_model); without a cache tokens may be
        (B, T) with positions (T,) (training)."""
        x = self.wte(tokens) * self.cfg.embed_scale
        x = x + (self.wpe(positions) if self.cfg.learned_positions else self._pe.on(x.device)[positions].to(x.dtype))
        for block in self.blocks:
            x = block(x, meta, cache)
        return self.ln_f(x) if self.ln_f is not None else x

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab), causal, without a KV cache (training)."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.compute_logits(self(tokens, positions, None, None))

    @property
    def pe(self) -> torch.Tensor:
        """The sinusoidal position table, (max_position, d_model) float32 on the CPU."""
        return self._pe.on(torch.device("cpu"))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) -> (N, vocab) with the output layer tied to the token embedding."""
        return linear(hidden, self.wte.weight)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random weights: the same model on every machine for one seed."""
        params = dict(self.named_parameters())
        for name, value in self.seeded_tensors(seed):
            params[name].copy_(value)

    def seeded_tensors(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 CPU tensor) of every parameter's seeded value, drawn one at a time in
        parameter order (a tensor-parallel rank slices each as it comes; works on the meta device)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                yield name, torch.zeros(p.shape)
            elif ".ln_" in name or name.startswith("ln_"):
                yield name, torch.ones(p.shape)
            else:
                yield name, torch.randn(p.shape, generator=gen) * self._init_std(name)

    def _init_std(self, name: str) -> float:
        if name == "wte.weight" and self.cfg.arch == "transformer":
            return self.cfg.d_model**-0.5  # unit variance after the sqrt(d_model) scale
        if ".score." in name:  # additive attention's W_q, W_k, v: keep tanh out of saturation
            return self.cfg.d_head**-0.5
        return 0.02


QKV_ARCHITECTURE = "QKVTransformerForCausalLM"


def _parse_qkv_config(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    """Our config.json: the ModelConfig fields, plus bookkeeping keys that are ignored."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in raw.items() if k in fields})


def _qkv_config_json(cfg: ModelConfig) -> dict[str, Any]:
    return {"architectures": [QKV_ARCHITECTURE], "model_type": "qkv-transformer", **dataclasses.asdict(cfg)}


# Our own checkpoints: config.json carries the ModelConfig fields, tensors our parameter names.
QKV = ArchitectureSpec(parse_config=_parse_qkv_config, name_map=lambda model, _names: identity_map(model),
                       config_json=_qkv_config_json)
