"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with the q/k/v
projections fused into one `qkv_proj` (rows: q, then k, then v) and gate/up into one
`gate_up_proj`, kept fused here as the checkpoint stores them (one matmul each, names
unchanged); LongRoPE (`short_factor`/`long_factor`) and partial rotary (Phi-4-mini rotates
3/4 of each head) come from the shared RoPE, with HF Phi-3's recompute of a sequence growing
past original_max_position_embeddings (RopeScaling.recompute_past_original); Phi-3-mini-4k's sliding window from the shared
attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from model.config import ModelConfig
from model.layers.linear.dense import Linear
from model.layers.mlp import FusedGatedMLP
from model.models.llama import LlamaAttention, LlamaForCausalLM, _parser, _name_map, _skip
from model.models.weight_map import ArchitectureSpec


class Phi3Attention(LlamaAttention):
    """LlamaAttention reading q, k and v from one fused projection, as the checkpoint stores it."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.d_head, bias=cfg.qkv_bias)
        self.fused = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """The Llama model with Phi-3's fused attention and MLP projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, make_mlp=lambda c, _layer: FusedGatedMLP(c))
        for i, layer in enumerate(self.layers):
            layer.self_attn = Phi3Attention(cfg, i)


def _parse(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    cfg = _parser(qkv_bias=False, qk_norm=False)(raw, has_tokenizer)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "longrope":
        # Phi3ForCausalLM.prepare_inputs_for_generation: a sequence growing past the original
        # context is recomputed with the long factors.
        cfg = cfg.replace(rope_scaling=dataclasses.replace(cfg.rope_scaling, recompute_past_original=True))
    return cfg.replace(arch="phi3")


PHI3 = ArchitectureSpec(parse_config=_parse, name_map=_name_map, skip=_skip)
