"""Qwen2-VL's vision tower: a ViT over 14x14 (x2 frames) patches at the image's own resolution,
2-D rotary positions (row, column) inside each frame, and a merger that folds each 2x2 block of
patches into one decoder token (LayerNorm, then an MLP to the decoder's width).

Qwen2.5-VL's (`VisionConfig.window_size` > 0) has RMSNorms, a gated SiLU MLP, and attends inside
windows of merged patches except in a few full-attention blocks: the patches are put in window
order before the blocks and the merged tokens back in raster order after the merger."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import VisionConfig
from model.layers.norms import RMSNorm
from model.layers.positions import PerDevice, rope_inv_freq
from model.layers.vision import VisionMLP, activation

def patch_positions(grid_thw: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(t*h*w, 2) (row, column) of each patch, in the processor's order: merge x merge blocks
    row-major, patches row-major inside each block, every frame the same."""
    t, h, w = grid_thw
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    cols = cols.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention among one frame's patches, q and k rotated by (row, column)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x (N, dim), cos/sin (N, 1, head_dim) float32 -> (N, dim). Each patch attends to the
        patches of its segment (consecutive runs of `segments` lengths: frames, or windows)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, d) each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        if len(set(segments)) == 1:  # equal segments (frames): one batched call, (S, H, N/S, d)
            q, k, v = (t.reshape(len(segments), -1, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, -1)
        else:
            out = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in parts)).transpose(0, 1)
                             for parts in zip(*(t.split(segments) for t in (q, k, v)))]).reshape(n, -1)
        return self.proj(out)


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = activation(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def vision_norm(v: VisionConfig, dim: int) -> nn.Module:
    """Qwen2-VL's LayerNorm, or Qwen2.5-VL's RMSNorm (eps 1e-6 both)."""
    return RMSNorm(dim, 1e-6) if v.window_size else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.norm1 = vision_norm(v, v.hidden_size)
        self.norm2 = vision_norm(v, v.hidden_size)
        self.attn = VisionAttention(v.hidden_size, v.num_heads)
        self.mlp = GatedVisionMLP(v) if v.window_size else VisionMLP(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one decoder token: LayerNorm, Linear, GELU, Linear."""

    def __init__(self, v: VisionConfig, out_dim: int) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = vision_norm(v, v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (N / merge^2, out_dim)


class Qwen2VisionTower(nn.Module):
    """pixel_values (patches, C*t*p*p) of one image and its grid (t, h, w) -> (t*h*w / merge^2, out_dim)."""

    def __init__(self, v: VisionConfig, out_dim: int, rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.v = v
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(v) for _ in range(v.depth))
        self.merger = PatchMerger(v, out_dim)
        spatial = v.hidden_size // v.num_heads // 2  # half of each head rotates by row, half by column
        # A constant, not a buffer: a model loaded through the meta device gets its buffers
        # uninitialised (model/layers/positions.py keeps its tables the same way).
        self.inv_freq = PerDevice(rope_inv_freq(spatial, rope_theta, None))

    def rotary(self, grid_thw: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, 1, head_dim) float32 of each patch's (row, column)."""
        device = self.patch_embed.proj.weight.device
        pos = patch_positions(grid_thw, self.v.spatial_merge_size).to(device)  # (N, 2)
        freqs = (pos[..., None].float() * self.inv_freq.on(device)).flatten(1)  # (N, head_dim / 2): rows' then columns'
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        v, weight = self.v, self.patch_embed.proj.weight
        x = pixel_values.to(weight.dtype).view(-1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed.proj(x).view(-1, v.hidden_size)  # (N, hidden)
        cos, sin = self.rotary(grid_thw)
        frames = [grid_thw[1] * grid_thw[2]] * grid_thw[0]
        order, windows = None, frames
        if v.window_size:  # patches (in merge units) into window order, cos/sin with them
            order, windows = window_order(grid_thw, v.spatial_merge_size, v.window_size // v.patch_size)
            unit = v.spatial_merge_size ** 2
            x, cos, sin = (t.reshape(-1, unit, *t.shape[1:])[order].flatten(0, 1) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            full = not v.window_size or i in v.full_attention_blocks
            x = block(x, cos, sin, frames if full else windows)
        out = self.merger(x)  # (N / merge^2, out_dim)
        return out if order is None else out[torch.argsort(order)]


def window_order(grid_thw: tuple[int, int, int], merge: int, window_patches: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merged tokens of each frame cut into squares of
    window_patches / merge tokens a side (the last row and column of windows smaller); returns the
    merged tokens' window-major order and each window's length in patches."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    side = window_patches // merge
    index = torch.arange(t * h * w).reshape(t, h, w)
    order, lengths = [], []
    for f in range(t):
        for r in range(0, h, side):
            for c in range(0, w, side):
                win = index[f, r:r + side, c:c + side].flatten()
                order.append(win)
                lengths.append(win.numel() * merge * merge)
    return torch.cat(order), lengths
