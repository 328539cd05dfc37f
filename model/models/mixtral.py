"""Mixtral: the Llama/Mistral decoder with a sparse mixture of experts in place of the MLP
(8 experts, top-2, softmax over all experts then the top 2 renormalised, weights in float32).

The model (`MoEForCausalLM`, `arch="moe"`) is the Llama decoder (`model.models.llama`) with
`model.layers.moe.SparseMoE` as each layer's feed-forward, or a dense SwiGLU in the layers the
config keeps dense; the Qwen-MoE family (`model.models.qwen_moe`) runs on the same module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from torch import nn

from model.config import ModelConfig, MoEConfig
from model.layers.mlp import GatedMLP
from model.layers.moe import SparseMoE
from model.models.expert_weights import stacked
from model.models.llama import LlamaForCausalLM, _parser, _skip
from model.models.weight_map import ArchitectureSpec, TensorSpec, identity_map


def moe_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: the experts, or a dense SwiGLU of d_ff in `dense_layers`."""
    assert cfg.moe is not None
    return GatedMLP(cfg) if layer in cfg.moe.dense_layers else SparseMoE(cfg)


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose feed-forward is `moe_mlp` (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, make_mlp=moe_mlp)


def parse_moe(raw: dict[str, Any], has_tokenizer: bool, qkv_bias: bool | None, qk_norm: bool,
              moe: MoEConfig, d_ff: int) -> ModelConfig:
    """The Llama family's config reading, as arch "moe" with `moe` and the dense layers' d_ff."""
    cfg = _parser(qkv_bias, qk_norm)(raw, has_tokenizer)
    return dataclasses.replace(cfg, arch="moe", moe=moe, d_ff=d_ff)


def parse_mixtral(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    moe = MoEConfig(num_experts=int(raw.get("num_local_experts", 8)), top_k=int(raw.get("num_experts_per_tok", 2)),
                    d_expert=int(raw["intermediate_size"]), norm_topk_prob=True, fp32_weights=True)
    return parse_moe(raw, has_tokenizer, None, False, moe, d_ff=int(raw["intermediate_size"]))


# Per-expert tensor names (gate, up, down) under `...experts.{e}.`.
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def moe_name_map(model: nn.Module, tensor_names: Collection[str], block: str,
                 expert_names: tuple[str, str, str]) -> dict[str, TensorSpec]:
    """HF's names under `model.` (head: `lm_head.weight`). The MoE block is `layers.N.{block}`
    (Mixtral's published checkpoints: `block_sparse_moe`) with one tensor per expert, or
    `layers.N.mlp` with fused `experts.gate_up_proj` / `experts.down_proj` as ours."""
    names = identity_map(model, prefix="model.")
    if "lm_head.weight" in names:
        names["lm_head.weight"] = TensorSpec("lm_head.weight")
    fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in tensor_names)
    gate, up, down = expert_names
    for ours in list(names):
        layer, dot, rest = ours.partition(".mlp.")
        if not dot or not rest.startswith(("gate.", "experts.")) or fused:
            continue
        hf = f"model.{layer}.{block}"
        if rest == "experts.gate_up_proj":
            n = model.cfg.moe.num_experts
            names[ours] = stacked([[f"{hf}.experts.{e}.{gate}.weight", f"{hf}.experts.{e}.{up}.weight"]
                                   for e in range(n)])
        elif rest == "experts.down_proj":
            names[ours] = stacked([[f"{hf}.experts.{e}.{down}.weight"] for e in range(model.cfg.moe.num_experts)])
        else:
            names[ours] = TensorSpec(f"{hf}.{rest}")
    return names


MIXTRAL = ArchitectureSpec(
    parse_config=parse_mixtral,
    name_map=lambda model, tensor_names: moe_name_map(model, tensor_names, "block_sparse_moe", MIXTRAL_EXPERT_NAMES),
    skip=_skip)
