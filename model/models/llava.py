"""LLaVA: a CLIP or SigLIP vision tower, a two-layer projector to the decoder's width, and a
Llama-family decoder whose image placeholder tokens take the projected patch features as embeddings.

HF transformers 5.25's `save_pretrained` writes the legacy names the llava-hf checkpoints have:
`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*` (the hub's with CLIP's
`vision_model.` inside) and `multi_modal_projector.*`; a checkpoint written with the names of HF's
module tree has `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`
and `lm_head.weight`. The name map takes whichever the checkpoint has.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from model.config import ModelConfig, VisionConfig
from model.layers.vision import ACTIVATIONS, activation
from model.models.clip import ClipVisionTower, used_layers
from model.models.llama import LLAMA_FAMILY, LlamaForCausalLM
from model.models.weight_map import ArchitectureSpec, CheckpointError, TensorSpec


class LlavaProjector(nn.Module):
    """linear_1 -> act -> linear_2: the tower's width to the decoder's."""

    def __init__(self, v: VisionConfig, d_model: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size, d_model, bias=v.projector_bias)
        self.act = activation(v.projector_act)
        self.linear_2 = nn.Linear(d_model, d_model, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The Llama-family decoder, a vision tower (`vision_tower`) and its projector (`multi_modal_projector`)."""

    # quantization (int8/int4) is for the decoder; the tower and the projector stay float
    float_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.vision is not None and cfg.vision.kind == "llava"
        self.vision_tower = ClipVisionTower(cfg.vision)
        self.multi_modal_projector = LlavaProjector(cfg.vision, cfg.d_model)
        # "default" drops the first token: CLIP's class token (and, as HF does, a SigLIP tower's first patch)
        self.drop_first = cfg.vision.feature_select == "default"

    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's pixel_values (1, C, S, S) -> its embeddings (tokens, d_model)."""
        weight = self.vision_tower.embeddings.patch_embedding.weight  # a convolution: never quantized
        features = self.vision_tower(data["pixel_values"].to(weight.device, weight.dtype))[0]  # (N, hidden)
        if self.drop_first:
            features = features[1:]
        return self.multi_modal_projector(features)


# ---- config.json and weight names -------------------------------------------------------

# text_config model_type -> the Llama-family architecture whose parser reads it
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
# What HF's config classes fill in when a config.json leaves a field out (llava-1.5's text_config
# names little more than its vocabulary; LlavaConfig's default tower is CLIP ViT-L/14 at 336).
LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "max_position_embeddings": 2048}
TOWER_DEFAULTS = {
    "clip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                          "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "num_channels": 3,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip_vision_model": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                            "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
LLAVA_TOWER = {"intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 336,
               "num_hidden_layers": 24, "num_attention_heads": 16, "model_type": "clip_vision_model"}


def _text_config(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    text = dict(raw.get("text_config") or {"model_type": "llama"})
    kind = text.get("model_type", "llama")
    if kind not in TEXT_ARCHITECTURES:
        raise CheckpointError(f"LLaVA's text_config model_type must be one of {', '.join(TEXT_ARCHITECTURES)}, "
                              f"got {kind!r}")
    if kind == "llama":
        text = {**LLAMA_DEFAULTS, **text}
    if raw.get("tie_word_embeddings"):  # LlavaConfig ties when either level says so
        text["tie_word_embeddings"] = True
    return LLAMA_FAMILY[TEXT_ARCHITECTURES[kind]].parse_config(text, has_tokenizer)


def _vision_config(raw: dict[str, Any]) -> VisionConfig:
    vc = dict(raw.get("vision_config") or LLAVA_TOWER)
    kind = vc.get("model_type", "clip_vision_model")
    if kind not in TOWER_DEFAULTS:
        raise CheckpointError(f"LLaVA's vision_config model_type must be one of {', '.join(TOWER_DEFAULTS)}, "
                              f"got {kind!r}")
    vc = {**TOWER_DEFAULTS[kind], **vc}
    layer = raw.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise CheckpointError(f"vision_feature_layer must be one layer index, got {layer!r} "
                              "(several concatenated layers are not supported)")
    select = raw.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise CheckpointError(f"vision_feature_select_strategy must be default or full, got {select!r}")
    for name, act in (("vision_config.hidden_act", vc["hidden_act"]),
                      ("projector_hidden_act", raw.get("projector_hidden_act", "gelu"))):
        if act not in ACTIVATIONS:
            raise CheckpointError(f"{name} must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    size, patch = vc["image_size"], vc["patch_size"]
    if not isinstance(size, int) or not isinstance(patch, int):
        raise CheckpointError(f"vision_config image_size and patch_size must be integers (a square image), "
                              f"got {size!r} and {patch!r}")
    token = raw.get("image_token_index", raw.get("image_token_id", 32000))
    v = VisionConfig(
        kind="llava", tower="clip" if kind == "clip_vision_model" else "siglip", image_token_id=int(token),
        hidden_size=vc["hidden_size"], depth=vc["num_hidden_layers"], num_heads=vc["num_attention_heads"],
        intermediate_size=vc["intermediate_size"], patch_size=patch, in_channels=vc["num_channels"],
        image_size=size, layer_norm_eps=float(vc["layer_norm_eps"]), hidden_act=vc["hidden_act"],
        feature_layer=layer, feature_select=select, projector_act=raw.get("projector_hidden_act", "gelu"),
        projector_bias=bool(raw.get("multimodal_projector_bias", True)))
    try:
        used_layers(v)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    return v


def parse_llava(raw: dict[str, Any], has_tokenizer: bool) -> ModelConfig:
    """config.json's `text_config` through its Llama-family parser, `vision_config` and the
    projector's fields into `ModelConfig.vision`."""
    return dataclasses.replace(_text_config(raw, has_tokenizer), arch="llava", vision=_vision_config(raw))


# Where each part may live, newest layout first: (text decoder, LM head, tower, projector).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
TOWER_PREFIXES = ("model.vision_tower.", "model.vision_tower.vision_model.", "vision_tower.",
                  "vision_tower.vision_model.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_TOWER = r"^(model\.)?vision_tower\.(vision_model\.)?"
_TOWER_UNUSED = re.compile(_TOWER + r"(post_layernorm\.|head\.|embeddings\.position_ids$)")
_TOWER_LAYER = re.compile(_TOWER + r"encoder\.layers\.(\d+)\.")


def _first(tensor_names: Collection[str], candidates: tuple[str, ...], probe: str) -> str:
    """The candidate prefix under which the checkpoint has `probe`; the newest when none has it
    (the loader then reports the newest layout's names as missing)."""
    return next((c for c in candidates if c + probe in tensor_names), candidates[0])


def _name_map(model: nn.Module, tensor_names: Collection[str]) -> dict[str, TensorSpec]:
    text = _first(tensor_names, TEXT_PREFIXES, "embed_tokens.weight")
    head = next((h for h in HEAD_NAMES if h in tensor_names), HEAD_NAMES[0])
    tower = _first(tensor_names, TOWER_PREFIXES, "embeddings.patch_embedding.weight")
    projector = _first(tensor_names, PROJECTOR_PREFIXES, "linear_1.weight")
    names = {}
    for ours, _ in model.named_parameters():
        if ours == "lm_head.weight":
            names[ours] = TensorSpec(head)
        elif ours.startswith("vision_tower."):
            names[ours] = TensorSpec(tower + ours.removeprefix("vision_tower."))
        elif ours.startswith("multi_modal_projector."):
            names[ours] = TensorSpec(projector + ours.removeprefix("multi_modal_projector."))
        else:
            names[ours] = TensorSpec(text + ours)
    return names


def _skip(cfg: ModelConfig, name: str) -> bool:
    """Rotary tables, a stored copy of a tied head, and the tower's parts LLaVA never reads: its
    post-LayerNorm, SigLIP's pooling head, and the layers after `vision_feature_layer`."""
    if name.endswith(".rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name in HEAD_NAMES):
        return True
    if _TOWER_UNUSED.match(name):
        return True
    layer = _TOWER_LAYER.match(name)
    return layer is not None and int(layer.group(3)) >= used_layers(cfg.vision)


LLAVA = ArchitectureSpec(parse_config=parse_llava, name_map=_name_map, skip=_skip)
