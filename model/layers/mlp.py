"""The position-wise feed-forward networks: the paper's act(x W1 + b1) W2 + b2, and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers.linear.dense import Linear
from model.layers.linear.fuse import fuse_parts


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2: d_model -> d_ff -> d_model (ReLU, or GELU for GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.d_model, cfg.d_ff)
        self.proj = Linear(cfg.d_ff, cfg.d_model)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.gelu(h, approximate="tanh") if self.gelu else F.relu(h)
        return self.proj(h)


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), d_model -> d_ff -> d_model; SwiGLU with `silu`
    (Llama), GeGLU with `gelu_tanh` (Gemma's gelu_pytorch_tanh). Loaded with HF's `gate_proj`
    and `up_proj`; `fuse_projections` makes them one `gate_up_proj` (gate rows first)."""

    def __init__(self, cfg: ModelConfig, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)
        self.act = GATE_ACTIVATIONS[activation]
        self.d_ff = cfg.d_ff
        self.fused = False

    def fuse_projections(self) -> bool:
        """gate and up as one product (model/layers/linear/fuse.py); False when they cannot be."""
        return fuse_parts(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split(self.d_ff, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """SwiGLU with gate and up in one projection (Phi-3's `gate_up_proj`, gate rows first):
    down(silu(gate) * up), d_model -> 2 d_ff -> d_model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.d_model, 2 * cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, d_ff) each
        return self.down_proj(up * F.silu(gate))
