"""What the vision-language models share: image embeddings put in place of their placeholder
tokens' embeddings, the activations vision towers and projectors name (HF's names), and the
towers' two-layer MLP."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.config import VisionConfig
from model.layers.kv_cache import AttnMetadata

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP, Qwen2-VL's tower
    "gelu": F.gelu,  # exact (erf): LLaVA's projector
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # SigLIP
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # the same tanh approximation, written out by HF
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation HF calls `name`; ValueError naming the ones there are."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def merge_image_embeds(x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """x (T, d_model) token embeddings -> the same with the rows of `meta.mm_embeds` (the image
    placeholders this step computes) replaced by their image embeddings; x itself when there are none."""
    if meta.mm_embeds is None:
        return x
    rows, embeds = meta.mm_embeds  # (N,) long, (N, d_model)
    return x.index_put((rows,), embeds.to(x.dtype))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))): the MLP of CLIP's, SigLIP's and Qwen2-VL's tower blocks (HF's names)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v.hidden_size, v.intermediate_size)
        self.fc2 = nn.Linear(v.intermediate_size, v.hidden_size)
        self.act = activation(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
