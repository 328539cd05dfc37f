"""Where stacked expert weights come from in each checkpoint layout, as `TensorSpec.load`s.

Our experts hold `gate_up_proj` (E, 2F, D) (gate rows, then up rows) and `down_proj`
(E, D, F) (`model.layers.moe.Experts`). Checkpoints store them as
- one tensor per expert and projection (what `save_pretrained` writes for Mixtral, `w1/w3/w2`,
  and Qwen-MoE, `gate_proj/up_proj/down_proj`, and how the published checkpoints are stored),
- fused (E, 2F, D) / (E, D, F) tensors as ours (transformers' in-memory layout): plain names,
- gpt-oss: (E, D, 2F) with gate and up interleaved column by column, (E, F, D) for down, in
  bf16, or MXFP4-packed as `*_blocks` + `*_scales` (dequantized here, expert by expert).

Each loader copies straight into the parameter slice by slice, so loading never holds more
than the parameter plus one checkpoint tensor (or one expert's dequantized weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model.models.weight_map import CheckpointError, TensorSource, TensorSpec

# The 16 values of an FP4 (E2M1) code: bit 3 is the sign, bits 0-2 index the magnitude.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values per shared exponent (16 bytes, two 4-bit codes per byte)
MXFP4_SCALE_BIAS = 127  # a scale byte s means 2 ** (s - 127)


def read(index: TensorSource, name: str, shape: Sequence[int]) -> torch.Tensor:
    """One checkpoint tensor, after checking its shape."""
    got = tuple(index.shape(name))
    if got != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(shape)} from config.json")
    return index.get_tensor(name)


def stacked(parts: list[list[str]]) -> TensorSpec:
    """param[e] = the tensors `parts[e]` concatenated along their first dimension
    (per-expert `[gate, up]` for gate_up_proj, `[down]` for down_proj)."""

    def load(index: TensorSource, param: torch.Tensor) -> None:
        rows = param.shape[1] // len(parts[0])
        for e, names in enumerate(parts):
            for i, name in enumerate(names):
                param[e, i * rows:(i + 1) * rows].copy_(read(index, name, (rows, *param.shape[2:])))

    flat = tuple(name for names in parts for name in names)
    return TensorSpec(flat[0], sources=flat, load=load)


def _deinterleave_into(param: torch.Tensor, rows: torch.Tensor) -> None:
    """param (..., 2F, X) <- rows (..., 2F, X) whose even rows are the gate's, odd rows the up's."""
    f = param.shape[-2] // 2
    param[..., :f, :].copy_(rows[..., 0::2, :])
    param[..., f:, :].copy_(rows[..., 1::2, :])


def gpt_oss_gate_up(name: str) -> TensorSpec:
    """(E, 2F, D) <- gpt-oss's (E, D, 2F), columns interleaved gate/up."""

    def load(index: TensorSource, param: torch.Tensor) -> None:
        e, f2, d = param.shape
        _deinterleave_into(param, read(index, name, (e, d, f2)).transpose(1, 2))

    return TensorSpec(name, sources=(name,), load=load)


def gpt_oss_gate_up_bias(name: str) -> TensorSpec:
    """(E, 2F) <- gpt-oss's interleaved (E, 2F)."""

    def load(index: TensorSource, param: torch.Tensor) -> None:
        _deinterleave_into(param.unsqueeze(-1), read(index, name, tuple(param.shape)).unsqueeze(-1))

    return TensorSpec(name, sources=(name,), load=load)


def gpt_oss_down(name: str) -> TensorSpec:
    """(E, D, F) <- gpt-oss's (E, F, D)."""

    def load(index: TensorSource, param: torch.Tensor) -> None:
        e, d, f = param.shape
        param.copy_(read(index, name, (e, f, d)).transpose(1, 2))

    return TensorSpec(name, sources=(name,), load=load)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dtype: blocks (..., G, 16) uint8, two FP4 codes per byte (low nibble first),
    scales (..., G) uint8 biased exponents, one per 32 values -> (..., G * 32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match: "
                              f"expected blocks (..., G, {MXFP4_BLOCK // 2}) and scales (..., G)")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., G, 16, 2)
    values = lut[codes].flatten(-2)  # (..., G, 32)
    exponents = (scales.to(torch.int32) - MXFP4_SCALE_BIAS).unsqueeze(-1)  # (..., G, 1)
    return torch.ldexp(values, exponents).flatten(-2)


def mxfp4(prefix: str, interleaved: bool) -> TensorSpec:
    """param (E, R, C) <- `{prefix}_blocks` (E, R, C/32, 16) + `{prefix}_scales` (E, R, C/32),
    one expert at a time; `interleaved`: R is gpt-oss's gate/up row interleaving."""
    blocks_name, scales_name = f"{prefix}_blocks", f"{prefix}_scales"

    def load(index: TensorSource, param: torch.Tensor) -> None:
        e, r, c = param.shape
        if c % MXFP4_BLOCK:
            raise CheckpointError(f"{prefix}: {c} columns are not a multiple of the MXFP4 block of {MXFP4_BLOCK}")
        blocks = read(index, blocks_name, (e, r, c // MXFP4_BLOCK, MXFP4_BLOCK // 2))
        scales = read(index, scales_name, (e, r, c // MXFP4_BLOCK))
        for i in range(e):
            weights = dequantize_mxfp4(blocks[i].to(param.device), scales[i].to(param.device), param.dtype)
            if interleaved:
                _deinterleave_into(param[i], weights)
            else:
                param[i].copy_(weights)

    return TensorSpec(blocks_name, sources=(blocks_name, scales_name), load=load)
