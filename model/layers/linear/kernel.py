"""The CPU kernel for weight-only quantized matmuls (`csrc/quant_matmul.cpp`), built with PyTorch's
extension mechanism on first use into the same per-user cache as the paged-attention kernel.

Why our own kernel: torch 2.13's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are
vectorised only for bfloat16 activations on x86 (float32 activations take a path 4-25x slower
than the dense float32 matmul), and bfloat16 activations put a single matmul 3e-3 (relative) off
the format's float32 math. This kernel keeps activations and sums in float32.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from model.layers.cpp_kernel import CppKernel, register_fake_once

logger = logging.getLogger(__name__)



def _register_fakes() -> None:
    """The ops' outputs for torch.compile's tracing: (M, N) float32, N the rows of the codes."""
    register_fake_once("qkv_quant::quant_matmul", lambda x, qweight, scales, offsets, bits, group:
                       x.new_empty(x.shape[0], qweight.shape[0], dtype=torch.float32))
    register_fake_once("qkv_quant::quant_matmul_q8", lambda x, qweight, scales, offsets, bits, group, path=-1:
                       x.new_empty(x.shape[0], qweight.shape[0], dtype=torch.float32))


_KERNEL = CppKernel("qkv_quant_matmul", Path(__file__).with_name("csrc") / "quant_matmul.cpp",
                    namespace="qkv_quant", op="quant_matmul", directory_prefix="quant_matmul",
                    fallback="quantized-matmul kernel unavailable, dequantizing blocks of rows instead", log=logger,
                    on_load=_register_fakes)

_INT8_PATH: dict[str, int] = {}


def kernel_available() -> bool:
    """Build (first call, a minute or two) or load the kernel; False, with one warning, when it
    cannot be built (the layers then dequantize blocks of rows and use the dense matmul)."""
    return _KERNEL.available()


def int8_path() -> int:
    """The kernel's product with int8 activations on this CPU: 2 AVX-512 VNNI, 1 AVX2, 0 none
    (not vectorised, or the kernel did not build)."""
    if "path" not in _INT8_PATH:
        _INT8_PATH["path"] = int(torch.ops.qkv_quant.int8_path()) if kernel_available() else 0
    return _INT8_PATH["path"]


def quant_matmul_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    bits: int, group_size: int, path: int = -1) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 with x rounded to int8 codes in blocks of 32 (llama.cpp's
    Q8_0) and integer dot products against the stored codes; `path` caps the vector path (tests)."""
    empty = scales.new_empty(0)
    return torch.ops.qkv_quant.quant_matmul_q8(x, qweight, scales, empty if offsets is None else offsets,
                                               bits, group_size, path)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bits: int, group_size: int) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 through the kernel (see csrc/quant_matmul.cpp)."""
    empty = scales.new_empty(0)
    return torch.ops.qkv_quant.quant_matmul(x, qweight, scales, empty if offsets is None else offsets,
                                            bits, group_size)
