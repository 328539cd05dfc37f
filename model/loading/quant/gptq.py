"""GPTQ checkpoints (AutoGPTQ / GPTQModel safetensors, `quantization_config.quant_method: "gptq"`).

Per quantized linear layer (K inputs, N outputs, G groups, pack = 32 / bits codes per int32):

- `qweight` int32 (K / pack, N): code of input k at bits [bits * (k % pack), ...) of row k // pack;
- `qzeros` int32 (G, N / pack): zero point of output n at bits [bits * (n % pack), ...) of column
  n // pack. `checkpoint_format: "gptq"` (the original format) stores zero - 1, so the zero point
  is stored + 1 (a stored 0 is 1; 2^bits - 1 reads back as 2^bits, never wrapping);
  `"gptq_v2"` stores the zero point itself;
- `scales` float16 (G, N); `g_idx` int32 (K,): the group of input k (k // group_size unless
  `desc_act`, where groups follow the order the columns were quantized in);

and W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k]. `group_size: -1` is one
group per row. `sym: true` only fixes every zero at 2^(bits - 1); the math is the same.
Columns of an act-order layer are permuted into group order at load (`QuantizedLinear.perm`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from model.layers.linear.quantized import QuantizedLinear
from model.loading.quant.packed import config_field, read, unpack_int32
from model.loading.quant.scheme import QuantScheme
from model.models.weight_map import CheckpointError

GPTQ_BITS = (4, 8)
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero point


def gptq_scheme(qc: dict[str, Any], where: str) -> QuantScheme:
    """`quantization_config` of a GPTQ checkpoint -> its scheme; CheckpointError naming the field
    and value of an unsupported variant (3-bit, Marlin/BitBLAS/exllama-only layouts, a quantized
    LM head)."""
    bits = config_field(qc, "bits", GPTQ_BITS, where)
    fmt = config_field(qc, "checkpoint_format", (*GPTQ_FORMATS, None), where)
    group = qc.get("group_size", -1)
    if not isinstance(group, int) or (group < 1 and group != -1):
        raise CheckpointError(f"quantization_config.group_size {group!r} in {where} must be -1 or a positive integer")
    desc_act = bool(qc.get("desc_act", False))
    if qc.get("lm_head"):
        raise CheckpointError(f"quantization_config.lm_head true in {where} is not supported (a quantized LM head)")
    zero_offset = GPTQ_FORMATS[fmt or "gptq"]
    return QuantScheme("gptq", bits, group, sym=bool(qc.get("sym", True)), desc_act=desc_act,
                       loader=partial(load_gptq_layer, bits=bits, group_size=group, zero_offset=zero_offset),
                       suffixes=(".qweight", ".qzeros", ".scales"), optional_suffixes=(".g_idx",))


def load_gptq_layer(index: Any, base: str, layer: QuantizedLinear, bits: int, group_size: int,
                    zero_offset: int) -> None:
    """Read `base`.qweight/.qzeros/.scales/.g_idx into `layer` (see the module docstring)."""
    k, n, pack = layer.in_features, layer.out_features, 32 // bits
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    if k % pack or n % pack:
        raise CheckpointError(f"{base}: {k} inputs and {n} outputs must be multiples of {pack} for {bits}-bit GPTQ")
    codes = unpack_int32(read(index, base + ".qweight", torch.int32, (k // pack, n)), bits, dim=0)  # (K, N)
    zeros = unpack_int32(read(index, base + ".qzeros", torch.int32, (groups, n // pack)), bits, dim=1) + zero_offset
    scales = index.get_tensor(base + ".scales")
    if tuple(scales.shape) != (groups, n) or not scales.is_floating_point():
        raise CheckpointError(f"tensor {base + '.scales'!r} is {scales.dtype} {list(scales.shape)}, "
                              f"expected float {[groups, n]}")
    in_order = torch.arange(k) // group
    g_idx = index.get_tensor(base + ".g_idx").long() if base + ".g_idx" in index else in_order
    if tuple(g_idx.shape) != (k,) or g_idx.min() < 0 or g_idx.max() >= groups:
        raise CheckpointError(f"tensor {base + '.g_idx'!r} must hold {k} group indices in [0, {groups})")
    perm = None
    if not torch.equal(g_idx, in_order):
        if layer.perm is None:
            raise CheckpointError(f"{base}.g_idx is not in column order but quantization_config.desc_act is false")
        if not bool((torch.bincount(g_idx, minlength=groups) == group).all()):
            raise CheckpointError(f"{base}.g_idx must give every group exactly {group} columns")
    if layer.perm is not None:
        perm = torch.argsort(g_idx, stable=True)  # input columns in group order
        codes = codes[perm]
    layer.set_codes(codes.t(), scales.t().float(), zeros.t().float(), perm)
