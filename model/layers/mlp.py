"""The position-wise feed-forward networks: the paper's act(x W1 + b1) W2 + b2, and SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig


class FeedForward(nn.Module):
    """FFN(x) = act(x W1 + b1) W2 + b2: d_model -> d_ff -> d_model (ReLU, or GELU for GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.gelu = cfg.activation == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.gelu(h, approximate="tanh") if self.gelu else F.relu(h)
        return self.proj(h)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), d_model -> d_ff -> d_model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
