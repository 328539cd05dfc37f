"""Qwen2-VL's multimodal RoPE positions: text tokens count up on all three axes; an image's tokens
take (temporal, row, column) positions offset from where the image starts, and the text after it
resumes past the image's widest axis (HF's `get_rope_index`)."""

from __future__ import annotations

import torch


def image_positions(start: int, grid_thw: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(3, t*h*w / merge^2) positions of one image's tokens, the first at `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt = torch.arange(t).view(-1, 1, 1).expand(t, h, w)
    hh = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    ww = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start  # (3, t*h*w)


def mrope_positions(num_tokens: int, images: list[tuple[int, int, tuple[int, int, int]]], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """(3, num_tokens) positions of a prompt whose images are (offset, length, grid_thw) in order,
    and the delta a token after the prompt adds to its index."""
    parts, pos, index = [], 0, 0
    for offset, length, grid in images:
        if offset > index:  # the text before this image
            parts.append(torch.arange(offset - index).expand(3, -1) + pos)
            pos += offset - index
        parts.append(image_positions(pos, grid, merge))
        pos += max(grid[1], grid[2]) // merge
        index = offset + length
    if num_tokens > index:
        parts.append(torch.arange(num_tokens - index).expand(3, -1) + pos)
        pos += num_tokens - index
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0
