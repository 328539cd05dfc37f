"""Projections that read the same input, fused into one product after the weights load.

A Llama-family layer reads its normed input through q, k and v, and through gate and up: five
products, each of which streams its weight and (on the CPU) starts the kernel's threads once.
Stacking the weights' rows makes that two products of the same bytes, and the outputs are the
parts side by side (`split` gives each back as a view). Each output row is still one weight
row's dot product with the input, so a fused product is the parts' products up to the kernel's
summation order (the HF parity tests check the tokens).

Every weight format fuses the same way, since each stores a row's codes, scales and offsets
with that row: float weights, int8 and int4 codes (on-the-fly, GPTQ, AWQ repacked). A
tensor-parallel rank fuses its own shards. Parts that cannot share one product (another kind of
layer, dtype or device, another quantized format, a different act-order permutation, a bias on
some only) stay apart. LoRA adapters still name the parts: `model/layers/lora.py` applies each
part's adapter to its slice of the fused output (`fused_from`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.layers.linear.dense import Linear
from model.layers.linear.quantized import QuantizedLinear

def fuse_linears(parts: Sequence[nn.Module], names: Sequence[str]) -> nn.Module | None:
    """One linear layer whose output is `parts`' outputs concatenated (in order), or None when
    they cannot share one product. The fused layer's `fused_from` names the parts and their sizes."""
    first = parts[0]
    if (len({type(p) for p in parts}) != 1 or type(first) not in (Linear, nn.Linear, QuantizedLinear)
            or any(p.in_features != first.in_features or (p.bias is None) != (first.bias is None) for p in parts)):
        return None
    fused = _fuse_quantized(parts) if isinstance(first, QuantizedLinear) else _fuse_dense(parts)
    if fused is not None:  # (part name, its output features) in output order, read by LoRA
        fused.fused_from = tuple((name, p.out_features) for name, p in zip(names, parts, strict=True))
    return fused


def _same(tensors: Sequence[torch.Tensor | None]) -> bool:
    """All None, or all of one dtype and device."""
    if all(t is None for t in tensors):
        return True
    if any(t is None for t in tensors):
        return False
    return len({(t.dtype, t.device) for t in tensors}) == 1


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach() for t in tensors], dim=0)


@torch.no_grad()
def _fuse_dense(parts: Sequence[nn.Module]) -> nn.Module | None:
    weights, biases = [p.weight for p in parts], [p.bias for p in parts]
    if not _same(weights) or not _same(biases):
        return None
    out = sum(p.out_features for p in parts)
    with torch.device("meta"):
        fused = Linear(parts[0].in_features, out, bias=biases[0] is not None)
    fused.weight = nn.Parameter(_cat(weights), requires_grad=False)
    if biases[0] is not None:
        fused.bias = nn.Parameter(_cat(biases), requires_grad=False)
    return fused


@torch.no_grad()
def _fuse_quantized(parts: Sequence[QuantizedLinear]) -> QuantizedLinear | None:
    first = parts[0]
    layout = {(p.bits, p.group_size, p.offsets is None, p.perm is None, p.int8_activations) for p in parts}
    if len(layout) != 1 or not _same([p.qweight for p in parts]) or not _same([p.bias for p in parts]):
        return None
    if first.perm is not None and not all(torch.equal(p.perm, first.perm) for p in parts):
        return None  # act-order: one input permutation for the fused product, or none
    out = sum(p.out_features for p in parts)
    fused = QuantizedLinear(first.in_features, out, first.bits, first.group_size, bias=first.bias is not None,
                            has_offsets=first.offsets is not None, act_order=first.perm is not None, device="meta")
    fused.qweight = _cat([p.qweight for p in parts])
    fused.scales = _cat([p.scales for p in parts])
    if first.offsets is not None:
        fused.offsets = _cat([p.offsets for p in parts])
    if first.perm is not None:
        fused.perm = first.perm
    if first.bias is not None:
        fused.bias = nn.Parameter(_cat([p.bias for p in parts]), requires_grad=False)
    fused.int8_activations = first.int8_activations
    return fused


def fuse_parts(owner: nn.Module, parts: tuple[str, ...], fused_name: str) -> bool:
    """Replace `owner`'s linear layers `parts` by one named `fused_name` and set `owner.fused`;
    False (nothing changed) when already fused or when the parts cannot share one product."""
    if owner.fused:
        return False
    fused = fuse_linears([getattr(owner, name) for name in parts], parts)
    if fused is None:
        return False
    for name in parts:
        delattr(owner, name)
    setattr(owner, fused_name, fused)
    owner.fused = True
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every module that offers it (`fuse_projections()`: Llama-family
    attention's q/k/v, the gated MLP's gate/up), in place; the number of modules fused."""
    return sum(bool(m.fuse_projections()) for m in list(model.modules())
               if callable(getattr(m, "fuse_projections", None)))
