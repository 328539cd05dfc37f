"""Position encodings shared by the architecture families: the paper's sinusoids and rotary
embeddings (RoPE, with Llama 3's and linear frequency scaling).

Constant tables (sinusoids, rotary frequencies) are computed in float32 on the CPU and are
not buffers: `model.to(dtype)` and loading onto the meta device leave them exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import RopeScaling


class PerDevice:
    """A constant CPU tensor with a copy per device, made on first use."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._copies = {torch.device("cpu"): tensor}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self._copies[torch.device("cpu")].to(device)
        return self._copies[device]


def sinusoidal_table(max_position: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...): (max_position, d_model)."""
    cpu = torch.device("cpu")
    pos = torch.arange(max_position, dtype=torch.float64, device=cpu)[:, None]
    inv = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu) / d_model)
    table = torch.zeros(max_position, d_model, dtype=torch.float64, device=cpu)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv[: d_model // 2])
    return table.float()


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim / 2,) float32 inverse frequencies theta^(-2i/d), rescaled as `scaling` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (theta**exponents)
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are divided by
    # `factor`, those shorter than context / high_freq_factor kept, the band between blended.
    old = scaling.original_max_position
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), in the rotate-half layout HF Llama uses."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.inv_freq = PerDevice(rope_inv_freq(head_dim, theta, scaling))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, head_dim), computed in float32 then cast."""
        freqs = positions[:, None].float() * self.inv_freq.on(positions.device)[None, :]  # (T, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, d)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (T, H, d) rotated by its position: x cos + rotate_half(x) sin."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
