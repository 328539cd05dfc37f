"""Batched LoRA: many adapters over one base model in the same forward pass.

`LoraLinear` wraps a linear module (nn.Linear or a quantized one) and holds, for each of
`max_loras` resident slots, that slot's A (r, in) and B * scale (out, r). A step's rows are
grouped by slot (`LoraBatch`): one pair of matmuls per adapter present in the step, added back
with `index_add_`; base-model rows are untouched. Weights are never merged.

The runner builds the step's `LoraBatch` (it lives in `AttnMetadata.lora`) and makes it the
active one of the shared `LoraState` for the duration of the forward, since the wrapped linears
sit below the model's `forward(tokens, positions, meta, cache)` signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from model.layers.linear.quantized import QuantizedLinear


@dataclass
class LoraBatch:
    """One step's rows by adapter slot: (slot, flat row indices (n,) long) per slot present."""

    groups: list[tuple[int, torch.Tensor]]

    @staticmethod
    def of(slots: list[int], device: torch.device) -> LoraBatch | None:
        """`slots[i]`: the slot of flat row i, -1 for the base model; None when no row has one."""
        t = torch.tensor(slots, dtype=torch.long)
        if not bool((t >= 0).any()):
            return None
        order = torch.argsort(t, stable=True)  # rows sorted by slot, base rows (-1) first
        keys, counts = torch.unique_consecutive(t[order], return_counts=True)
        pieces = torch.split(order.to(device), counts.tolist())
        return LoraBatch([(int(k), rows) for k, rows in zip(keys.tolist(), pieces) if k >= 0])


class LoraState:
    """The batch the wrapped layers read during one forward (None: base model only)."""

    def __init__(self) -> None:
        self.active: LoraBatch | None = None

    @contextlib.contextmanager
    def use(self, batch: LoraBatch | None) -> Iterator[None]:
        self.active = batch
        try:
            yield
        finally:
            self.active = None


class LoraLinear(nn.Module):
    """base(x) + per row of x its slot's x A^T (B scale)^T; rows without a slot get base(x)."""

    def __init__(self, base: nn.Module, state: LoraState, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.in_features, self.out_features = base.in_features, base.out_features
        # The activations' dtype: the weight's, or a quantized layer's scales'.
        ref = base.scales if isinstance(base, QuantizedLinear) else base.weight
        dtype = ref.dtype
        self.lora_a = torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=ref.device)
        self.lora_b = torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=ref.device)
        self.ranks = [0] * max_loras  # 0: the slot's adapter does not target this layer

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put A (r, in) and B already scaled (out, r) in `slot`; None clears it."""
        if a is None or b is None:
            self.ranks[slot] = 0
            return
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :, :r].copy_(b)
        self.ranks[slot] = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.active
        if batch is None:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)  # (T, in), (T, out)
        for slot, rows in batch.groups:
            r = self.ranks[slot]
            if r == 0:
                continue
            xs = flat_x.index_select(0, rows).to(self.lora_a.dtype)  # (n, in)
            delta = (xs @ self.lora_a[slot, :r].T) @ self.lora_b[slot, :, :r].T  # (n, out)
            flat_y.index_add_(0, rows, delta.to(flat_y.dtype))
        return y


def lora_targets(model: nn.Module) -> list[str]:
    """The linear modules an adapter may target: every linear inside the decoder layers
    (attention projections and MLP), not the LM head."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, QuantizedLinear)) and name.split(".")[0] in ("layers", "blocks")]


def wrap_lora(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoraState, dict[str, LoraLinear]]:
    """Replace every `lora_targets` module by a `LoraLinear` around it (in place); the shared state
    and the wrappers by the wrapped module's name."""
    state = LoraState()
    wrapped: dict[str, LoraLinear] = {}
    for name in lora_targets(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped[name] = LoraLinear(getattr(parent, child), state, max_loras, max_rank)
        setattr(parent, child, wrapped[name])
    return state, wrapped
