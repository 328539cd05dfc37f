"""AWQ checkpoints (AutoAWQ's GEMM layout, `quantization_config.quant_method: "awq"`, `version:
"gemm"`, 4 bits, zero points).

Per quantized linear layer (K inputs, N outputs, G = K / group_size groups):

- `qweight` int32 (K, N / 8): eight 4-bit codes per int32 along the outputs, interleaved: the
  word's slot i (bits [4i, 4i + 4)) holds output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] of column c;
- `qzeros` int32 (G, N / 8): the zero points, packed the same way; `scales` float16 (G, N);

and W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = k // group_size.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from model.layers.linear.quantized import QuantizedLinear
from model.loading.quant.packed import config_field, read, unpack_int32
from model.loading.quant.scheme import QuantScheme
from model.models.weight_map import CheckpointError

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a word holds output AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))  # output j sits in slot [j]


def awq_scheme(qc: dict[str, Any], where: str) -> QuantScheme:
    """`quantization_config` of an AWQ checkpoint -> its scheme; CheckpointError naming the field
    and value of an unsupported variant (gemv, gemv_fast, marlin, exllama or ipex layouts, other
    bit widths, no zero points)."""
    config_field(qc, "version", ("gemm", "GEMM"), where, default="gemm")
    bits = config_field(qc, "bits", (4,), where, default=qc.get("w_bit"))
    config_field(qc, "zero_point", (True,), where, default=True)
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group < 32 or group % 32:
        raise CheckpointError(f"quantization_config.group_size {group!r} in {where} is not supported: "
                              "supported are multiples of 32 (AWQ publishes 128)")
    return QuantScheme("awq", bits, group, sym=False, loader=partial(load_awq_layer, group_size=group),
                       suffixes=(".qweight", ".qzeros", ".scales"))


def load_awq_layer(index: Any, base: str, layer: QuantizedLinear, group_size: int) -> None:
    """Read `base`.qweight/.qzeros/.scales into `layer` (see the module docstring)."""
    k, n = layer.in_features, layer.out_features
    if n % 8 or k % group_size:
        raise CheckpointError(f"{base}: {n} outputs must be a multiple of 8 and {k} inputs of group size {group_size}")
    groups = k // group_size
    codes = unpack_int32(read(index, base + ".qweight", torch.int32, (k, n // 8)), 4, 1, AWQ_UNPACK_ORDER)
    zeros = unpack_int32(read(index, base + ".qzeros", torch.int32, (groups, n // 8)), 4, 1, AWQ_UNPACK_ORDER)
    scales = index.get_tensor(base + ".scales")
    if tuple(scales.shape) != (groups, n) or not scales.is_floating_point():
        raise CheckpointError(f"tensor {base + '.scales'!r} is {scales.dtype} {list(scales.shape)}, "
                              f"expected float {[groups, n]}")
    layer.set_codes(codes.t(), scales.t().float(), zeros.t().float())
