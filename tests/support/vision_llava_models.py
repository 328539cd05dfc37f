"""Tiny random LLaVA checkpoints (`LlavaForConditionalGeneration`: a Llama decoder behind a CLIP or
SigLIP tower) saved by HF `transformers` with their Pillow image processor's config and a byte-level
BPE tokenizer holding an `<image>` token, plus HF's own image-token expansion and greedy
continuation as the references. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.tiny_models import add_noise, build_tokenizer

IMAGE_TOKEN = "<image>"
TEXT_VOCAB = 300  # BPE ids 0..299 (0 is EOS); <image> is 300
IMAGE_TOKEN_ID = TEXT_VOCAB
VOCAB_SIZE = 320
IMAGE_SIZE, PATCH_SIZE = 28, 7  # 16 patches per image

# case -> (tower, vision_feature_layer, vision_feature_select_strategy, decoder overrides)
CASES: dict[str, tuple[str, int, str, dict[str, Any]]] = {
    "clip-layer-2-default": ("clip", -2, "default", {}),
    "siglip-layer-1-full-tied": ("siglip", -1, "full", {"tie_word_embeddings": True}),
    "siglip-layer-2-default": ("siglip", -2, "default", {}),
    "clip-layer1-full": ("clip", 1, "full", {"num_key_value_heads": 4}),
}


def random_image(seed: int, width: int = 40, height: int = 33):
    """A random RGB PIL image, the same for one seed."""
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def build_tiny_llava(case: str, seed: int = 0):
    """A random `LlavaForConditionalGeneration` (eval, fp32, eager attention) for `case` of CASES: a
    2-layer Llama decoder (width 64) and a 3-layer tower (width 32, 28x28 images in 7x7 patches).
    Biases and norm weights get noise (HF initialises them to 0 and 1), so a mix-up shows."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, \
        SiglipVisionConfig

    tower, layer, select, overrides = CASES[case]
    text = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=256,
                                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None,
                                 initializer_range=0.1), **overrides})
    vision_cls = CLIPVisionConfig if tower == "clip" else SiglipVisionConfig
    vision = vision_cls(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, initializer_range=0.1)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN_ID,
                         vision_feature_layer=layer, vision_feature_select_strategy=select,
                         tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    add_noise(model, ("norm",))
    return model


def save_tiny_llava(directory: str | Path, case: str, seed: int = 0) -> Path:
    """`build_tiny_llava(case, seed)` saved with `save_pretrained`, its image processor's
    `preprocessor_config.json` (CLIP's resize + center crop, or SigLIP's resize, to 28x28) and a
    `tokenizer.json` with `<image>` as id 300."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    directory = Path(directory)
    build_tiny_llava(case, seed).save_pretrained(directory)
    if CASES[case][0] == "clip":
        processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                          crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(directory)
    tok = build_tokenizer(TEXT_VOCAB)
    tok.add_special_tokens([IMAGE_TOKEN])
    assert tok.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tok.save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}), "utf-8")
    return directory


def image_tokens(hf_model) -> int:
    """How many tokens one image takes, from HF's config (as LlavaProcessor counts them)."""
    c = hf_model.config
    patches = (c.vision_config.image_size // c.vision_config.patch_size) ** 2
    cls = int(c.vision_config.model_type == "clip_vision_model")
    return patches + cls - int(c.vision_feature_select_strategy == "default")


def hf_inputs(directory: str | Path, hf_model, prompt: list[int], images: list) -> tuple[list[int], torch.Tensor]:
    """HF's model inputs: `prompt` with each `<image>` repeated once per image token, and the
    images' pixel_values (n, 3, 28, 28) from the checkpoint's image processor."""
    from transformers import AutoImageProcessor

    n = image_tokens(hf_model)
    ids = [t for tok in prompt for t in ([tok] * n if tok == IMAGE_TOKEN_ID else [tok])]
    processor = AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
    return ids, processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]


def hf_generate(hf_model, ids: list[int], pixel_values: torch.Tensor, max_new_tokens: int) -> list[int]:
    """HF's greedy continuation of the expanded prompt with its images, never stopping at EOS."""
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                pixel_values=pixel_values, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()
