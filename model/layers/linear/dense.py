"""Dense linear layers whose product for a few rows costs about what one row costs.

On the CPU, `F.linear` for one row is a matrix-vector product that streams the weight once; for
2 to 32 rows (a small decode batch, a speculative verification of 1 + k positions) it takes MKL's
small-M matrix product, which here ran 1.5-2.5x the time of one row for the same weight bytes.
The same product taken the other way round, `(W @ x^T)^T` with x contiguous, costs about one
row's time up to 4 rows and at most 1.05x `F.linear`'s up to 32 (`loadtests/benchmarks/bench_linear_rows.py`,
a whole model's weights read from memory; two runs); the engine's decode step at batch 2-32
took 0.55-0.88x the time (`--engine transformer-base-trained`). The result is made contiguous
again: left transposed, the next layer's product gets x^T contiguous, MKL's slow case once more.
Only float32 on the CPU takes this path; it is the same product up to float rounding (another
summation order).

Where the project's C++ kernel builds (`csrc/dense_matmul.cpp`, vectorised for AVX-512 or AVX2 +
FMA), products of 1 to `KERNEL_MAX_ROWS` rows take it instead, outside autograd: each thread
streams its share of the weight once. On this project's AMD EPYC (2 threads, GPT-2 small's
products, weights from memory) one row took 0.47-0.57x F.linear's time (22-24 ms for 498 MB:
about 21 GB/s), 2-32 rows 0.5-0.9x the better of the two torch forms, 64 rows 0.74-0.88x
F.linear's, 128 about the same (`loadtests/benchmarks/bench_linear_rows.py`, three runs); the
engine's GPT-2-small decode step took 0.52x (batch 1), 0.82x (16) and 0.93x (64) the time of
the transposed form (`--engine gpt2-small-random`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.cpp_kernel import CppKernel, register_fake_once

logger = logging.getLogger(__name__)

# Row counts that take the transposed product (measured: loadtests/benchmarks/bench_linear_rows.py).
SMALL_ROWS_MIN, SMALL_ROWS_MAX = 2, 32
KERNEL_MAX_ROWS = 64  # rows the dense kernel takes (bench_linear_rows.py: faster than F.linear up to 64, a tie at 128)



def _register_fakes() -> None:
    """The op's output for torch.compile's tracing: (M, N) in x's dtype."""
    register_fake_once("qkv_dense::dense_matmul", lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))


_KERNEL = CppKernel("qkv_dense_matmul", Path(__file__).with_name("csrc") / "dense_matmul.cpp",
                    namespace="qkv_dense", op="dense_matmul", directory_prefix="dense_matmul",
                    fallback="dense small-batch kernel unavailable, using torch's products", log=logger,
                    on_load=_register_fakes)
_use_kernel: dict[str, bool] = {}  # "on" -> the kernel built, is vectorised, and is not switched off


def kernel_available() -> bool:
    """Build (first call, about a minute) or load the dense kernel; False, with one warning, when
    it cannot be built or has no vector path for this CPU (torch's products are used then)."""
    if "on" not in _use_kernel:
        _use_kernel["on"] = _KERNEL.available() and bool(torch.ops.qkv_dense.vectorised())
    return _use_kernel["on"]


def set_kernel(enabled: bool | None) -> None:
    """Switch the dense kernel off (False), back on where it builds (True), or to be decided
    again on the next product (None): for benchmarks and tests that compare the paths."""
    _use_kernel.pop("on", None)
    if enabled is False:
        _use_kernel["on"] = False
    elif enabled:
        kernel_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x (..., K), weight (N, K) -> (..., N), contiguous."""
    rows = x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.shape[-1] else 0)
    if rows < 1 or not (x.is_cpu and x.dtype is torch.float32 and weight.dtype is torch.float32):
        return F.linear(x, weight, bias)
    if (rows <= KERNEL_MAX_ROWS and _use_kernel.get("on", False) and not torch.is_grad_enabled()
            and weight.is_contiguous()):
        x2 = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])
        y = torch.ops.qkv_dense.dense_matmul(x2, weight, x2.new_empty(0) if bias is None else bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    if not SMALL_ROWS_MIN <= rows <= SMALL_ROWS_MAX:
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])  # (M, K)
    # MKL's fast case is W (N, K) times a transposed view of a contiguous x: keep both that way
    yt = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x2.t())  # (N, M)
    y = yt.t().contiguous()  # (M, N)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, state dict and init) computed by `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
