"""Tiny random vision-language checkpoints saved by HF `transformers` with their image processors'
configs and a chat tokenizer, and test images drawn with numpy. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.support.chat_tokenizers import write_chat_tokenizer
from tests.support.tiny_models import add_noise

# Qwen2-VL's special tokens in the "qwen2_vl" chat tokenizer (tests/support/chat_tokenizers.py), by id.
QWEN2_VL_IDS = {"vision_start": 3, "vision_end": 4, "image_pad": 5, "video_pad": 6, "im_end": 2}


def random_image(seed: int, width: int = 120, height: int = 90):
    """A random RGB PIL image, the same for one seed."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def build_tiny_qwen2_vl(seed: int = 0, vocab_size: int = 400, version: str = "2"):
    """A random `Qwen2VLForConditionalGeneration` (version "2") or `Qwen2_5_VLForConditionalGeneration`
    ("2.5") in eval mode: 2 decoder layers (width 64, 4 heads, 2 KV heads, M-RoPE sections 2/3/3)
    and a vision tower of width 32 over patches of 14 with a 2x2 merge: Qwen2-VL's 2 blocks, or
    Qwen2.5-VL's 4 (blocks 1 and 3 full attention, the others in windows of 56 pixels: 2x2 merged
    tokens, so a 112x84 image has windows of 4, 2, 4 and 2... tokens)."""
    import transformers

    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                bos_token_id=None, eos_token_id=QWEN2_VL_IDS["im_end"], pad_token_id=0)
    if version == "2":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                      fullatt_block_indexes=[1, 3], hidden_act="silu")
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=QWEN2_VL_IDS["image_pad"],
                          video_token_id=QWEN2_VL_IDS["video_pad"],
                          vision_start_token_id=QWEN2_VL_IDS["vision_start"],
                          vision_end_token_id=QWEN2_VL_IDS["vision_end"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    add_noise(model, ("norm", "ln_q"))
    return model


def save_tiny_qwen2_vl(directory: str | Path, seed: int = 0, max_pixels: int = 28 * 28 * 64,
                       version: str = "2") -> Path:
    """`build_tiny_qwen2_vl` saved with its Qwen2-VL image processor (at most `max_pixels`, so at most
    64 image tokens) and the "qwen2_vl" chat tokenizer, in `directory`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    build_tiny_qwen2_vl(seed, version=version).save_pretrained(directory)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(directory)
    write_chat_tokenizer(directory, "qwen2_vl")
    gen = {"eos_token_id": [QWEN2_VL_IDS["im_end"], 0], "pad_token_id": 0}
    (directory / "generation_config.json").write_text(json.dumps(gen), "utf-8")
    return directory


def hf_qwen2_vl_inputs(directory: str | Path, ids: list[int], images: list) -> dict[str, torch.Tensor]:
    """HF's model inputs for an already expanded prompt `ids` and its images (the checkpoint's own
    image processor, the token types M-RoPE needs)."""
    from transformers import AutoImageProcessor

    t = torch.tensor([ids])
    inputs = {"input_ids": t, "mm_token_type_ids": (t == QWEN2_VL_IDS["image_pad"]).long()}
    if images:
        inputs.update(AutoImageProcessor.from_pretrained(str(directory))(images=images, return_tensors="pt"))
    return inputs
