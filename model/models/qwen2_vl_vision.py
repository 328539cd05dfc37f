"""Qwen2-VL's vision tower: a ViT over 14x14 (x2 frames) patches at the image's own resolution,
2-D rotary positions (row, column) inside each frame, and a merger that folds each 2x2 block of
patches into one decoder token (LayerNorm, then an MLP to the decoder's width)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import VisionConfig

ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def activation(name: str):
    """The activation HF names `name` (ValueError for one we do not have)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: int) -> torch.Tensor:
        """x (N, dim), cos/sin (N, 1, head_dim) float32 -> (N, dim); N = frames * patches per frame."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, d) each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        # (frames, H, N/frames, d): attention stays inside each frame
        q, k, v = (t.reshape(frames, n // frames, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # (frames, H, N/frames, d)
        return self.proj(out.transpose(1, 2).reshape(n, -1))


class VisionMlp(nn.Module):
    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = activation(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(v.hidden_size, eps=1e-6)
        self.attn = VisionAttention(v.hidden_size, v.num_heads)
        self.mlp = VisionMlp(v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one decoder token: LayerNorm, Linear, GELU, Linear."""

    def __init__(self, v: VisionConfig, out_dim: int) -> None:
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = nn.LayerNorm(v.hidden_size, eps=1e-6)
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
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, spatial, 2).float() / spatial),
                             persistent=False)

    def rotary(self, grid_thw: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (N, 1, head_dim) float32 of each patch's (row, column)."""
        pos = patch_positions(grid_thw, self.v.spatial_merge_size).to(self.inv_freq.device)  # (N, 2)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # (N, head_dim / 2): rows' then columns'
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        v, weight = self.v, self.patch_embed.proj.weight
        x = pixel_values.to(weight.dtype).view(-1, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        x = self.patch_embed.proj(x).view(-1, v.hidden_size)  # (N, hidden)
        cos, sin = self.rotary(grid_thw)
        for block in self.blocks:
            x = block(x, cos, sin, grid_thw[0])
        return self.merger(x)
