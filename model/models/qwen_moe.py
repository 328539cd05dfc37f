"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention with a sparse mixture of experts.

Both route by a float32 softmax over all experts, then the top k, renormalised only with
`norm_topk_prob` (Qwen2-MoE checkpoints set it false, Qwen3-MoE true), the weights cast back
to the model's dtype. Qwen2-MoE adds a shared expert to every token, scaled by
sigmoid(shared_expert_gate(x)). A layer i is sparse when it is not in `mlp_only_layers` and
(i + 1) is a multiple of `decoder_sparse_step`; the others keep a dense SwiGLU of
`intermediate_size` (the experts' is `moe_intermediate_size`). Runs on Mixtral's module.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from model.config import ModelConfig, MoEConfig
from model.models.llama import _skip
from model.models.mixtral import QWEN_EXPERT_NAMES, moe_name_map, parse_moe
from model.models.weight_map import ArchitectureSpec, TensorSpec


def num_experts(raw: dict[str, Any]) -> int:
    """`num_experts` (Qwen's checkpoints), or `num_local_experts` (what transformers 5 saves)."""
    return int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])


def dense_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """The layers that keep a dense MLP (HF's Qwen2MoeDecoderLayer rule)."""
    step, only = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or [])
    sparse = num_experts(raw) > 0
    return tuple(i for i in range(raw["num_hidden_layers"]) if i in only or not sparse or (i + 1) % step)


def _moe(raw: dict[str, Any], shared: bool) -> MoEConfig:
    return MoEConfig(num_experts=max(num_experts(raw), 1), top_k=int(raw["num_experts_per_tok"]),
                     d_expert=int(raw["moe_intermediate_size"]), norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                     shared_expert=int(raw.get("shared_expert_intermediate_size") or 0) if shared else 0,
                     dense_layers=dense_layers(raw))


def parse_qwen2_moe(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    return parse_moe(raw, has_tokenizer, bool(raw.get("qkv_bias", True)), False, _moe(raw, shared=True),
                     d_ff=int(raw["intermediate_size"]))


def parse_qwen3_moe(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    return parse_moe(raw, has_tokenizer, None, True, _moe(raw, shared=False), d_ff=int(raw["intermediate_size"]))


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    return moe_name_map(model, tensor_names, "mlp", QWEN_EXPERT_NAMES)


QWEN2_MOE = ArchitectureSpec(parse_config=parse_qwen2_moe, name_map=_name_map, skip=_skip)
QWEN3_MOE = ArchitectureSpec(parse_config=parse_qwen3_moe, name_map=_name_map, skip=_skip)
