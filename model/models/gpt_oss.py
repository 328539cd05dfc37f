"""gpt-oss (20b, 120b): the Llama decoder with attention sinks, alternating sliding-window and
full layers (`layer_types`), YaRN RoPE, biases on q/k/v/o, and a mixture of experts with a
biased router that takes the top 4 logits then a softmax over them, experts with biases and
a clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 * gate), gate <= 7 and |up| <= 7.

Runs on the MoE module (`model.models.mixtral.MoEForCausalLM`) with its own RMSNorm. The checkpoint's experts are
`mlp.experts.gate_up_proj` (E, D, 2F) with gate and up interleaved column by column and
`down_proj` (E, F, D), in bf16, or MXFP4-packed (`*_blocks` + `*_scales`, as openai/gpt-oss
ships them), which is dequantized at load, expert by expert, to the model's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig, MoEConfig
from model.models.expert_weights import gpt_oss_down, gpt_oss_gate_up, gpt_oss_gate_up_bias, mxfp4
from model.layers.norms import RMSNorm
from model.models.llama import _parser, _skip
from model.models.mixtral import MoEForCausalLM
from model.models.weight_map import ArchitectureSpec, TensorSpec, identity_map

SWIGLU_ALPHA = 1.702  # fixed in the reference implementation; newer configs carry `swiglu_alpha`


def parse_gpt_oss(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    moe = MoEConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw.get("num_experts_per_tok", 4)),
                    d_expert=int(raw["intermediate_size"]), routing="topk_softmax", router_bias=True,
                    expert_bias=True, activation="gpt_oss", swiglu_alpha=float(raw.get("swiglu_alpha", SWIGLU_ALPHA)),
                    swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    cfg = _parser(None, False)(raw, has_tokenizer)  # attention_bias: q/k/v and o biases
    return dataclasses.replace(cfg, arch="gpt_oss", moe=moe, attention_sinks=True)


class GptOssRMSNorm(RMSNorm):
    """gpt-oss's RMSNorm casts back to the input dtype after the weight multiply, Llama's before
    it: the same in float32; in bf16, on a tiny random gpt-oss, the Llama order put logits 0.16
    off HF's, this one 0.02."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class GptOssForCausalLM(MoEForCausalLM):
    """The MoE decoder with gpt-oss's RMSNorms (arch "gpt_oss")."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is RMSNorm:
                    setattr(module, name, GptOssRMSNorm(child.weight.shape[0], child.eps))


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    """HF's names under `model.`; the router is `mlp.router`; the experts' stacked tensors are
    read through the layout converters (bf16 interleaved, or MXFP4 blocks and scales)."""
    names = identity_map(model, prefix="model.")
    if "lm_head.weight" in names:
        names["lm_head.weight"] = TensorSpec("lm_head.weight")
    for ours in list(names):
        layer, dot, rest = ours.partition(".mlp.")
        if not dot:
            continue
        hf = f"model.{layer}.mlp.{rest}"
        if rest.startswith("gate."):
            names[ours] = TensorSpec(f"model.{layer}.mlp.router.{rest.removeprefix('gate.')}")
        elif rest in ("experts.gate_up_proj", "experts.down_proj") and f"{hf}_blocks" in tensor_names:
            names[ours] = mxfp4(hf, interleaved=rest == "experts.gate_up_proj")
        elif rest == "experts.gate_up_proj":
            names[ours] = gpt_oss_gate_up(hf)
        elif rest == "experts.gate_up_proj_bias":
            names[ours] = gpt_oss_gate_up_bias(hf)
        elif rest == "experts.down_proj":
            names[ours] = gpt_oss_down(hf)
    return names


GPT_OSS = ArchitectureSpec(parse_config=parse_gpt_oss, name_map=_name_map, skip=_skip)
