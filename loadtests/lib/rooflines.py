"""The machine's bounds, measured: copy bandwidth and matmul peak, which a benchmark's figures
are compared with (and which every result file's `machine` records)."""

from __future__ import annotations

import time
from typing import Any

import torch


def sync(device: Any) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock reads finished work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: Any, dtype: torch.dtype, size: int = 2048, repeats: int = 10) -> float:
    """The best rate of one size x size matmul, in GFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def copy_bandwidth_gbs(device: Any, mib: int = 512, repeats: int = 10) -> float:
    """Copy bandwidth: bytes read plus bytes written per second by a `mib` MiB float32 copy, best
    of `repeats`, in GB/s."""
    src = torch.empty(mib << 18, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def read_bandwidth_gbs(device: Any, mib: int = 512, repeats: int = 9) -> float:
    """Read bandwidth: bytes read per second by a sum over a `mib` MiB float32 tensor (a read with
    nothing written back, as a batch-1 decode step reads its weights), the median of `repeats`
    passes in GB/s. The median, not the best: on a shared machine single passes move by a third,
    and a bound that one lucky pass sets is not one a decode step can be held to."""
    src = torch.empty(mib << 18, device=device, dtype=torch.float32).fill_(1.0)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        src.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return src.numel() * 4 / times[len(times) // 2] / 1e9
