"""Qwen2-VL and Qwen2.5-VL: a Qwen2 decoder whose rotary positions are three
(M-RoPE: temporal, height, width), fed image embeddings from its own vision tower
(qwen2_vl_vision.py) in place of the image's placeholder tokens.

The engine hands the decoder each step's (3, T) positions in `meta.mrope_positions` when a
sequence with images is in the batch (model/engine/image_step.py); text-only rows have their
position on all three axes, which is plain RoPE.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig, VisionConfig
from model.layers.kv_cache import AttnMetadata
from model.models.llama import LlamaForCausalLM, RopeTables, _parser, rope_params
from model.models.qwen2_vl_vision import Qwen2VisionTower
from model.models.weight_map import ArchitectureSpec, CheckpointError, TensorSpec


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Llama-family decoder with M-RoPE and a vision tower (`visual`)."""

    float_prefixes = ("visual.",)  # quantization (int8/int4) is for the decoder; the tower stays float

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.vision is not None and cfg.mrope_section is not None
        self.visual = Qwen2VisionTower(cfg.vision, cfg.d_model)

    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's pixel_values (patches, C*t*p*p) and image_grid_thw (1, 3) -> (tokens, d_model)."""
        grid = tuple(int(x) for x in data["image_grid_thw"][0])
        return self.visual(data["pixel_values"].to(self.embed_tokens.weight.device), grid)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, meta: AttnMetadata) -> RopeTables:
        """M-RoPE: the step's (3, T) positions when a sequence with images is in it, else each row's
        position on all three axes (plain RoPE)."""
        pos3 = meta.mrope_positions if meta.mrope_positions is not None else positions.expand(3, -1)
        return self.rotary.mrope_cos_sin(pos3, dtype, self.cfg.mrope_section)


# ---- config.json and weight names -------------------------------------------------------

_qwen2 = _parser(qkv_bias=True, qk_norm=False)


def parse_qwen2_vl(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    """transformers 5's nested `text_config`/`vision_config`, or the older flat layout (text fields
    at the top, `rope_scaling: {type: mrope, mrope_section}`)."""
    text = dict(raw.get("text_config") or raw)
    params = dict(rope_params(text))
    section = params.pop("mrope_section", None)
    if not section:
        raise CheckpointError("Qwen2-VL's config has no mrope_section in rope_parameters / rope_scaling")
    if params.get("rope_type", params.get("type")) in ("mrope", "default", None):
        params["rope_type"] = "default"
        params.pop("type", None)
    text["rope_parameters"] = params
    text.pop("rope_scaling", None)
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    text.setdefault("vocab_size", raw.get("vocab_size"))
    cfg = _qwen2(text, has_tokenizer)
    vision = _vision_config(raw, raw["vision_config"])
    if sum(section) * 2 != cfg.d_head:
        raise CheckpointError(f"mrope_section {section} must cover half of head_dim {cfg.d_head}")
    out = raw["vision_config"].get("out_hidden_size" if vision.window_size else "hidden_size", cfg.d_model)
    if out != cfg.d_model:
        raise CheckpointError(f"the vision tower's output width {out} must equal the decoder's {cfg.d_model}")
    return cfg.replace(arch="qwen2_vl", vision=vision, mrope_section=tuple(section))


def _vision_config(raw: dict[str, Any], vc: dict[str, Any]) -> VisionConfig:
    """Qwen2-VL's vision_config (embed_dim wide, mlp_ratio), or Qwen2.5-VL's (hidden_size wide,
    intermediate_size, windows and full-attention blocks, `out_hidden_size` the decoder's width)."""
    qwen25 = raw.get("model_type") == "qwen2_5_vl" or "fullatt_block_indexes" in vc
    width = vc["hidden_size"] if qwen25 else vc["embed_dim"]
    return VisionConfig(
        kind="qwen2_vl", image_token_id=int(raw["image_token_id"]), hidden_size=width, depth=vc["depth"],
        num_heads=vc["num_heads"],
        intermediate_size=vc["intermediate_size"] if qwen25 else int(width * vc.get("mlp_ratio", 4)),
        patch_size=vc.get("patch_size", 14), in_channels=vc.get("in_channels", 3),
        spatial_merge_size=vc.get("spatial_merge_size", 2), temporal_patch_size=vc.get("temporal_patch_size", 2),
        hidden_act=vc.get("hidden_act", "silu" if qwen25 else "quick_gelu"),
        vision_start_token_id=raw.get("vision_start_token_id"),
        window_size=vc.get("window_size", 112) if qwen25 else 0,
        full_attention_blocks=tuple(vc.get("fullatt_block_indexes", ())) if qwen25 else ())


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    """transformers 5: `model.visual.*`, `model.language_model.*`; older: `visual.*`, `model.*`."""
    new = "model.language_model.embed_tokens.weight" in tensor_names
    names = {}
    for ours, _ in model.named_parameters():
        if ours.startswith("visual."):
            names[ours] = TensorSpec(("model." if new else "") + ours)
        elif ours.startswith("lm_head."):
            names[ours] = TensorSpec(ours)
        else:
            names[ours] = TensorSpec(("model.language_model." if new else "model.") + ours)
    return names


def _skip(cfg: ModelConfig, name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


QWEN2_VL = ArchitectureSpec(parse_config=parse_qwen2_vl, name_map=_name_map, skip=_skip)
