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
    """base(x) + per row of x its slot's x A^T (B scale)^T; rows without a slot get base(x).

    A base fused from parts at load (`fused_from`, model/layers/linear/fuse.py: q/k/v, gate/up)
    has one segment per part, each with its own A and B per slot, added to the part's columns of
    the output: an adapter of the unfused model's `q_proj` applies to the fused `qkv_proj` unchanged."""

    def __init__(self, base: nn.Module, state: LoraState, max_loras: int, max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.state = state
        self.in_features, self.out_features = base.in_features, base.out_features
        parts = getattr(base, "fused_from", None) or (("", self.out_features),)
        offsets = [sum(size for _, size in parts[:i]) for i in range(len(parts))]
        self.segments = [(name, offset, size) for (name, size), offset in zip(parts, offsets, strict=True)]
        # The activations' dtype: the weight's, or a quantized layer's scales'.
        ref = base.scales if isinstance(base, QuantizedLinear) else base.weight
        dtype = ref.dtype
        self.lora_a = torch.zeros(max_loras, len(parts), max_rank, self.in_features, dtype=dtype, device=ref.device)
        self.lora_b = torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=ref.device)
        self.ranks = [[0] * len(parts) for _ in range(max_loras)]  # 0: the slot's adapter skips that segment

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, segment: int = 0) -> None:
        """Put A (r, in) and B already scaled (size, r) in `slot` for `segment`; None clears it."""
        if a is None or b is None:
            self.ranks[slot][segment] = 0
            return
        _, offset, size = self.segments[segment]
        r = a.shape[0]
        self.lora_a[slot, segment, :r].copy_(a)
        self.lora_b[slot, offset:offset + size, :r].copy_(b)
        self.ranks[slot][segment] = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.active
        if batch is None:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)  # (T, in), (T, out)
        for slot, rows in batch.groups:
            xs = None
            for segment, (_, offset, size) in enumerate(self.segments):
                r = self.ranks[slot][segment]
                if r == 0:
                    continue
                if xs is None:
                    xs = flat_x.index_select(0, rows).to(self.lora_a.dtype)  # (n, in)
                b = self.lora_b[slot, offset:offset + size, :r]
                delta = (xs @ self.lora_a[slot, segment, :r].T) @ b.T  # (n, size)
                flat_y[:, offset:offset + size].index_add_(0, rows, delta.to(flat_y.dtype))
        return y


class LoraSegment:
    """One part of a fused projection as an adapter names it (`layers.0.self_attn.q_proj`): its
    shape, and its slots in the fused layer's `LoraLinear`."""

    def __init__(self, layer: LoraLinear, segment: int) -> None:
        self.layer, self.segment = layer, segment
        self.in_features, self.out_features = layer.in_features, layer.segments[segment][2]

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        self.layer.set_slot(slot, a, b, self.segment)


def lora_targets(model: nn.Module) -> list[str]:
    """The linear modules an adapter may target: every linear inside the decoder layers
    (attention projections and MLP), not the LM head."""
    return [name for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, QuantizedLinear)) and name.split(".")[0] in ("layers", "blocks")]


LoraTarget = LoraLinear | LoraSegment


def wrap_lora(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoraState, dict[str, LoraTarget]]:
    """Replace every `lora_targets` module by a `LoraLinear` around it (in place); the shared state
    and what adapters target, by the names of the unfused model: each wrapper by its module's name,
    and a fused projection's parts (`LoraSegment`) by theirs."""
    state = LoraState()
    wrapped: dict[str, LoraTarget] = {}
    for name in lora_targets(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = LoraLinear(getattr(parent, child), state, max_loras, max_rank)
        setattr(parent, child, layer)
        if getattr(layer.base, "fused_from", None):
            for segment, (part, _, _) in enumerate(layer.segments):
                wrapped[f"{parent_name}.{part}"] = LoraSegment(layer, segment)
        else:
            wrapped[name] = layer
    return state, wrapped
