"""Weight-only quantized linear layers: int8 and 4-bit codes with float32 scales (and offsets).

One storage for every scheme (on-the-fly int8/int4, GPTQ, AWQ): row n of W (out_features N,
in_features K) is split into groups of `group_size` columns, and

    W[n, k] = q[n, k] * scales[n, g] + offsets[n, g],   g = k // group_size

which is (q - z) * s with offsets = -z * s. `qweight` is int8 (N, K) for 8 bits and, for 4 bits,
uint8 (N, K/2): in each block of 32 columns byte j holds column j (low nibble) and j + 16 (high
nibble). GPTQ's act-order (`desc_act`) checkpoints group columns in a permuted order; `perm`
(K,) lists the input columns in group order and the input is permuted once per call.

On the CPU, up to `KERNEL_MAX_ROWS` rows (decode) go through the float32 kernel in
`model/layers/linear/kernel.py`; longer inputs (prefill) and other devices dequantize blocks of
rows and use the dense matmul. A layer with `int8_activations` set (the engine's
`quantization_activations`) takes the kernel's other product for every row count on the CPU:
activations rounded to int8 codes in blocks of 32, as llama.cpp's Q8_0, and integer dot products
against the stored codes. On CUDA, 4-bit layers with bfloat16 inputs use torch's tinygemm
kernel (`_weight_int4pack_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.linear.kernel import int8_path, kernel_available, quant_matmul, quant_matmul_q8

INT4_GROUP_SIZES = (32, 64, 128)
KERNEL_MAX_ROWS = 32  # more rows than this: dequantize blocks of rows and use the dense matmul
_BLOCK_ELEMENTS = 1 << 22  # float32 weights dequantized at once on that path (16 MiB)


# ---- the formats' math ----------------------------------------------------------------------

def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel: w (N, K) -> q int8 in [-127, 127], scales (N, 1) float32;
    w ~ q * scales."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise: w (N, K) -> codes uint8 in [0, 15] (N, K), scales and zero points
    (N, K / group_size) float32; w ~ (codes - zeros) * scales. The range [min, max] of each group
    (widened to hold 0) maps onto 0..15."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=2).clamp(max=0.0)
    hi = g.amax(dim=2).clamp(min=0.0)
    scales = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    codes = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scales, zeros


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/2) uint8 in the kernel's layout (K a multiple of 32)."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).reshape(n, k // 32, 2, 16)  # (N, blocks, low/high half, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: (N, K/2) uint8 -> (N, K) uint8 codes."""
    n, half = packed.shape
    b = packed.reshape(n, half // 16, 1, 16)
    return torch.cat([b & 15, b >> 4], dim=2).reshape(n, half * 2)


# ---- the layer --------------------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held as codes, scales and offsets (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 has_offsets: bool, act_order: bool = False, device: torch.device | str | None = None) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if group_size < 1 or in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide in_features {in_features}")
        if bits == 4 and group_size % 32:
            raise ValueError(f"4-bit groups must be a multiple of 32 columns, got {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        groups = in_features // group_size
        cols = in_features if bits == 8 else in_features // 2
        self.register_buffer("qweight", torch.empty(out_features, cols, device=device,
                                                    dtype=torch.int8 if bits == 8 else torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, device=device))
        self.register_buffer("offsets", torch.empty(out_features, groups, device=device) if has_offsets else None)
        self.register_buffer("perm", torch.empty(in_features, dtype=torch.long, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self._tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None
        self.int8_activations = False  # CPU: round x to int8 blocks and multiply codes (set_int8_activations)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, act_order={self.perm is not None}")

    @torch.no_grad()
    def set_codes(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  perm: torch.Tensor | None = None, rows: slice = slice(None)) -> None:
        """Fill `rows` (default all) from codes (n, K) in group order (columns `perm` of the input
        when act-order), scales (n, G) and zero points (n, G) or None (8-bit symmetric, signed
        codes): W = (codes - zeros) * scales."""
        scales = scales.float()
        if self.bits == 8:
            if zeros is None:
                self.qweight[rows] = codes.to(torch.int8)
            else:  # unsigned 0..255 codes stored as signed: q - 128, and the offset moves by 128 * s
                self.qweight[rows] = (codes.to(torch.int16) - 128).to(torch.int8)
                zeros = zeros.float() - 128
        else:
            self.qweight[rows] = pack_int4(codes)
        self.scales[rows] = scales
        if self.offsets is not None:
            self.offsets[rows] = -zeros.float() * scales if zeros is not None else torch.zeros_like(scales)
        if self.perm is not None:
            self.perm.copy_(perm)
        self._tinygemm = None

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor) -> None:
        """Quantize a float weight (N, K) into this layer (int8 symmetric or int4 asymmetric), a
        block of rows at a time so that the float32 temporaries stay small (a vocabulary-sized
        LM head is hundreds of MB)."""
        step = max(1, _BLOCK_ELEMENTS // self.in_features)
        for r0 in range(0, self.out_features, step):
            rows = slice(r0, min(self.out_features, r0 + step))
            if self.bits == 8:
                q, scales = quantize_int8(weight[rows])
                self.set_codes(q, scales, None, rows=rows)
            else:
                codes, scales, zeros = quantize_int4(weight[rows], self.group_size)
                self.set_codes(codes, scales, zeros, rows=rows)

    def codes(self) -> torch.Tensor:
        """(N, K) codes as stored (group order), int16."""
        q = self.qweight if self.bits == 8 else unpack_int4(self.qweight)
        return q.to(torch.int16)

    def _decode_rows(self, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows r0:r1 of W in group order, (r1 - r0, K) in `dtype`."""
        return self._decode(slice(r0, r1), dtype)

    def _decode(self, rows: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` (a slice or an index tensor) of W in group order, (n, K) in `dtype`."""
        q = self.qweight[rows]
        q = (q if self.bits == 8 else unpack_int4(q)).to(dtype)
        n, groups = q.shape[0], self.in_features // self.group_size
        w = q.view(n, groups, self.group_size) * self.scales[rows][:, :, None].to(dtype)
        if self.offsets is not None:
            w = w + self.offsets[rows][:, :, None].to(dtype)
        return w.view(n, self.in_features)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` (any shape) of W, dequantized: (*index.shape, K) (an embedding lookup)."""
        if self.perm is not None:
            raise ValueError("row lookup of an act-order layer is not supported")
        return self._decode(index.reshape(-1), dtype).view(*index.shape, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """W (N, K) float32 in the input's own column order."""
        w = self._decode_rows(0, self.out_features, torch.float32)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.device.type == "cpu" and self.int8_activations and self.group_size % 32 == 0 and int8_path() > 0:
            y = quant_matmul_q8(x2.float().contiguous(), self.qweight, self.scales, self.offsets, self.bits,
                                self.group_size).to(x.dtype)
        elif x2.device.type == "cpu" and x2.shape[0] <= KERNEL_MAX_ROWS and kernel_available():
            y = quant_matmul(x2.float().contiguous(), self.qweight, self.scales, self.offsets, self.bits,
                             self.group_size).to(x.dtype)
        elif self._use_tinygemm(x2):
            y = self._tinygemm_matmul(x2)
        else:
            y = self._blockwise(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def _blockwise(self, x2: torch.Tensor) -> torch.Tensor:
        """Dequantize blocks of rows of W and use the dense matmul (float32 on the CPU)."""
        dtype = torch.float32 if x2.device.type == "cpu" else x2.dtype
        xc = x2.to(dtype)
        step = max(1, _BLOCK_ELEMENTS // self.in_features)
        if step >= self.out_features:
            return F.linear(xc, self._decode_rows(0, self.out_features, dtype)).to(x2.dtype)
        y = torch.empty(x2.shape[0], self.out_features, dtype=dtype, device=x2.device)
        for r0 in range(0, self.out_features, step):
            r1 = min(self.out_features, r0 + step)
            y[:, r0:r1] = F.linear(xc, self._decode_rows(r0, r1, dtype))
        return y.to(x2.dtype)

    # CUDA: torch's tinygemm int4 kernel (bfloat16 activations, its own packing, built on first
    # use). Not exercised by the CPU test suite.
    def _use_tinygemm(self, x2: torch.Tensor) -> bool:
        return (x2.device.type == "cuda" and x2.dtype == torch.bfloat16 and self.bits == 4
                and self.group_size in INT4_GROUP_SIZES and self.in_features % 128 == 0
                and self.out_features % 8 == 0)

    def _tinygemm_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self._tinygemm is None:
            codes = unpack_int4(self.qweight).to(torch.int32)
            packed_u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # tinygemm's input order
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
            # tinygemm computes (q - 8) * s + zero: with W = q * s + offset, zero = offset + 8 * s
            offsets = self.offsets if self.offsets is not None else torch.zeros_like(self.scales)
            sz = torch.stack([self.scales.t(), (offsets + 8 * self.scales).t()], dim=-1)
            self._tinygemm = (packed, sz.to(torch.bfloat16).contiguous())
        packed, sz = self._tinygemm
        return torch.ops.aten._weight_int4pack_mm(x2.contiguous(), packed, self.group_size, sz)


class QuantizedEmbedding(nn.Module):
    """A token embedding read from a quantized (vocab, d_model) matrix: the tied LM head's, so
    the head and the lookup share one quantized copy."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens, self.dtype)


class WeightSink:
    """What the checkpoint loader copies a float `weight` into when its layer is quantized: the
    shape it checks, and `copy_` quantizing the tensor into the layer."""

    def __init__(self, layer: QuantizedLinear) -> None:
        self.layer = layer
        self.shape = torch.Size((layer.out_features, layer.in_features))

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return 1

    def copy_(self, tensor: torch.Tensor) -> None:
        self.layer.quantize_from(tensor)
