"""A prompt's images after processing: pixels as the encoder takes them, where their tokens sit in
the prompt, and the hash that names them for the prefix and encoder caches."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ImageItem:
    """One image of one prompt.

    `data`: the image processor's tensors for this image alone (Qwen2-VL: `pixel_values`
    (patches, C*t*p*p) and `image_grid_thw` (1, 3); LLaVA: `pixel_values` (1, C, H, W)).
    `offset`, `length`: the prompt positions its `length` placeholder tokens fill.
    `hash`: sha256 of the decoded pixels (mode, size, bytes), so the same picture sent twice, in any
    encoding, is one image to the caches and any other picture is a different one."""

    hash: bytes
    offset: int
    length: int
    data: dict[str, torch.Tensor] = field(repr=False)
    # (rows, cols) of the patches (after any merge), row-major: the image's token j shows patch
    # j - (length - rows * cols); a negative index is not a patch (CLIP's class token).
    grid: tuple[int, int] = (0, 0)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalInputs:
    """A prompt's images, in prompt order, and (Qwen2-VL) the M-RoPE positions of its tokens.

    `positions`: (3, P) long, the (temporal, height, width) rotary position of each prompt token;
    `rope_delta`: what a token after the prompt adds to its index to get its (equal) three
    positions. None and 0 for a model without M-RoPE."""

    images: tuple[ImageItem, ...]
    positions: torch.Tensor | None = None
    rope_delta: int = 0

    def hash_keys(self) -> list[tuple[int, int, int]]:
        """(offset, length, key) per image: the signed 64-bit key that stands for the image in the
        prefix cache's block hashes (`Sequence.hash_token_ids`). Negative, so never a token id."""
        return [(im.offset, im.length, -1 - (int.from_bytes(im.hash[:8], "little") >> 1)) for im in self.images]

    def prompt_positions(self, start: int, stop: int) -> torch.Tensor:
        """(3, stop - start) positions of prompt tokens [start, stop)."""
        assert self.positions is not None
        return self.positions[:, start:stop]


def image_hash(image: Any) -> bytes:
    """sha256 of a PIL image's mode, size and decoded bytes."""
    h = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()
