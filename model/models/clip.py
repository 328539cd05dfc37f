"""The CLIP and SigLIP vision towers LLaVA puts in front of its decoder: a ViT over the square image's
patches, bidirectional attention, pre-LayerNorm blocks.

CLIP prepends a learned class token and LayerNorms the embeddings (`pre_layrnorm`, HF's spelling);
SigLIP has neither, and its patch projection has a bias. Only the layers up to the one LLaVA reads
(`VisionConfig.feature_layer`) are built: the rest of the tower, its post-LayerNorm and SigLIP's
pooling head never touch an image token. Parameter names are HF's `CLIPVisionModel`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import VisionConfig
from model.layers.vision import VisionMLP


def used_layers(v: VisionConfig) -> int:
    """How many encoder layers produce HF's `hidden_states[feature_layer]` (index 0: the embeddings,
    -1: the last layer's output). ValueError when the index is outside the tower."""
    k = v.feature_layer if v.feature_layer >= 0 else v.depth + 1 + v.feature_layer
    if not 0 <= k <= v.depth:
        raise ValueError(f"vision_feature_layer {v.feature_layer} is outside a tower of {v.depth} layers "
                         f"(allowed: {-(v.depth + 1)} to {v.depth})")
    return k


class VisionEmbeddings(nn.Module):
    """Patches (a stride-p convolution), CLIP's class token first, plus learned positions."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.siglip = v.tower == "siglip"
        self.image_size, self.patch_size = v.image_size, v.patch_size
        if not self.siglip:
            self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, stride=v.patch_size,
                                         bias=self.siglip)
        positions = (v.image_size // v.patch_size) ** 2 + (0 if self.siglip else 1)
        self.position_embedding = nn.Embedding(positions, v.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, hidden); N = patches (+1 for CLIP's class token)."""
        h, w = pixel_values.shape[-2:]
        if (h, w) != (self.image_size, self.image_size):  # the learned positions are for this side only
            raise ValueError(f"the vision tower takes {self.image_size}x{self.image_size} images, got {h}x{w} "
                             "(the checkpoint's image processor should crop or resize to that size)")
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # (B, patches, hidden)
        if not self.siglip:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)  # (B, 1, hidden)
            x = torch.cat([cls, x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Multi-head attention among all of one image's tokens, no mask."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        d = v.hidden_size
        self.num_heads, self.head_dim = v.num_heads, d // v.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d)."""
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, N, hd)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, hd), scale hd ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionEncoderLayer(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The layers, under HF's `encoder.layers.N` names (the tower runs them)."""

    def __init__(self, v: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(v) for _ in range(num_layers))


class ClipVisionTower(nn.Module):
    """pixel_values (B, C, S, S) -> HF's `hidden_states[feature_layer]` (B, N, hidden)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        if v.tower not in ("clip", "siglip"):
            raise ValueError(f"vision tower must be clip or siglip, got {v.tower!r}")
        self.embeddings = VisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps) if v.tower == "clip" else None
        self.encoder = VisionEncoder(v, used_layers(v))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)  # (B, N, hidden)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers:
            x = layer(x)
        return x
