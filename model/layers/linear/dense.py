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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Row counts that take the transposed product (measured: loadtests/benchmarks/bench_linear_rows.py).
SMALL_ROWS_MIN, SMALL_ROWS_MAX = 2, 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x (..., K), weight (N, K) -> (..., N), contiguous."""
    rows = x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.shape[-1] else 0)
    if not (SMALL_ROWS_MIN <= rows <= SMALL_ROWS_MAX and x.is_cpu and x.dtype is torch.float32
            and weight.dtype is torch.float32):
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
