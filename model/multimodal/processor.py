"""From a prompt with one placeholder token per image and the decoded images, to the prompt the
engine runs (each placeholder repeated once per image embedding) and its `MultiModalInputs`.

The pixels are prepared by HF's own image processor, read from the checkpoint directory (offline):
its resizing and normalisation are the ones the model was trained with. How many tokens an image
takes follows from the processed shape and the model's `VisionConfig`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from model.config import VisionConfig
from model.multimodal.inputs import ImageItem, MultiModalInputs, image_hash
from model.multimodal.mrope import mrope_positions

logger = logging.getLogger(__name__)


class ImageInputError(ValueError):
    """A request's images do not fit its prompt or cannot be processed; the message says why."""


class ImageProcessor:
    """HF's image processor of one checkpoint, and the placeholder expansion of its model."""

    def __init__(self, hf_processor: Any, vision: VisionConfig) -> None:
        self.hf = hf_processor
        self.vision = vision

    @classmethod
    def from_directory(cls, directory: str | Path, vision: VisionConfig) -> ImageProcessor:
        """The checkpoint's `preprocessor_config.json` through `AutoImageProcessor` (Pillow backend,
        no download); a ValueError when the directory has none."""
        from transformers import AutoImageProcessor

        if not (Path(directory) / "preprocessor_config.json").is_file():
            raise ValueError(f"{directory} has no preprocessor_config.json: a vision model needs its image "
                             "processor's config next to its weights")
        return cls(AutoImageProcessor.from_pretrained(str(directory), local_files_only=True), vision)

    def num_tokens(self, data: dict[str, torch.Tensor]) -> int:
        """How many placeholder tokens (= encoder output rows) one processed image takes."""
        v = self.vision
        if v.kind == "qwen2_vl":
            return int(data["image_grid_thw"].prod()) // (v.spatial_merge_size ** 2)
        h, w = data["pixel_values"].shape[-2:]
        # CLIP prepends a class token; "default" drops the first token (the class token, or as HF does
        # for a SigLIP tower, its first patch)
        return (h // v.patch_size) * (w // v.patch_size) + int(v.tower == "clip") - int(v.feature_select == "default")

    def patch_grid(self, data: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(rows, cols) of the patches (merged ones for Qwen2-VL) one processed image is cut into."""
        v = self.vision
        if v.kind == "qwen2_vl":
            _, h, w = (int(x) for x in data["image_grid_thw"][0])
            return h // v.spatial_merge_size, w // v.spatial_merge_size
        h, w = data["pixel_values"].shape[-2:]
        return h // v.patch_size, w // v.patch_size

    def _check_size(self, data: dict[str, torch.Tensor]) -> None:
        """A fixed-size tower (LLaVA's) takes only its own image_size; an image processor config that
        makes another size is refused here, as a request error, not inside an engine step."""
        side = self.vision.image_size
        if side and tuple(data["pixel_values"].shape[-2:]) != (side, side):
            h, w = data["pixel_values"].shape[-2:]
            raise ImageInputError(f"the image processor made {w}x{h} pixels but the vision tower takes {side}x{side}: "
                                  "the checkpoint's preprocessor_config.json does not match its config.json")

    def preprocess(self, image: Any) -> dict[str, torch.Tensor]:
        """One decoded PIL image -> the processor's tensors for it."""
        out = self.hf(images=[image.convert("RGB")], return_tensors="pt")
        keys = ("pixel_values", "image_grid_thw") if self.vision.kind == "qwen2_vl" else ("pixel_values",)
        return {k: out[k] for k in keys}

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> tuple[list[int], MultiModalInputs]:
        """Expand each placeholder of `prompt_token_ids` (the model's image token, once per image, in
        order) to its image's tokens. ImageInputError when placeholders and images do not pair up."""
        token = self.vision.image_token_id
        places = [i for i, t in enumerate(prompt_token_ids) if t == token]
        if len(places) != len(images):
            raise ImageInputError(f"the prompt has {len(places)} image placeholder(s) (token id {token}) "
                                  f"for {len(images)} image(s); each image needs exactly one")
        ids: list[int] = []
        items: list[ImageItem] = []
        prev = 0
        for place, image in zip(places, images):
            data = self.preprocess(image)
            self._check_size(data)
            n = self.num_tokens(data)
            ids.extend(prompt_token_ids[prev:place])
            items.append(ImageItem(image_hash(image), len(ids), n, data, self.patch_grid(data)))
            ids.extend([token] * n)
            prev = place + 1
        ids.extend(prompt_token_ids[prev:])
        if self.vision.kind != "qwen2_vl":
            return ids, MultiModalInputs(tuple(items))
        grids = [(im.offset, im.length, tuple(int(x) for x in im.data["image_grid_thw"][0])) for im in items]
        positions, delta = mrope_positions(len(ids), grids, self.vision.spatial_merge_size)
        return ids, MultiModalInputs(tuple(items), positions, delta)

