"""Reading packed-integer checkpoint tensors (GPTQ and AWQ share the layout's pieces)."""

from __future__ import annotations

from typing import Any

import torch

from model.models.weight_map import CheckpointError


def config_field(qc: dict[str, Any], name: str, allowed: Any, where: str, default: Any = None) -> Any:
    """`quantization_config[name]` (or `default`), refused with a CheckpointError unless in `allowed`."""
    value = qc.get(name, default)
    if value not in allowed:
        raise CheckpointError(f"quantization_config.{name} {value!r} in {where} is not supported: "
                              f"supported are {', '.join(map(repr, allowed))}")
    return value


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Codes packed 32 / bits to an int32 along `dim` -> one code per element (int32). Code i of a
    word sits at bits [bits * i, bits * (i + 1)); `order[j]` is the slot of element j of the word
    (AWQ interleaves them), default slot j."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., pack): slot i
    if order is not None:
        codes = codes[..., list(order)]
    if dim == 0:  # (R, C, pack) -> (R, pack, C) -> (R * pack, C)
        return codes.permute(0, 2, 1).reshape(packed.shape[0] * pack, packed.shape[1])
    return codes.reshape(packed.shape[0], packed.shape[1] * pack)


def read(index: Any, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor of a quantized layer, checked for dtype and shape."""
    t = index.get_tensor(name)
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise CheckpointError(f"tensor {name!r} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
    return t
