"""How big the KV cache is, decided once at start-up, and what refuses a start.

vLLM's rule, on CUDA: the engine may use `gpu_memory_utilization` of the device's total memory;
the weights and the activation peak of a profiling run (a forward pass of `max_num_batched_tokens`
tokens and the sampler's logits for `max_num_seqs` rows) are taken from that share, and the KV
cache gets the rest. `kv_cache_memory_bytes` sets the cache outright; on the CPU, where there is
nothing to profile against, its default is `CPU_KV_CACHE_BYTES` (or QKV_CPU_KVCACHE_SPACE GiB).
A `max_model_len` one sequence cannot fill is refused here, naming the largest that fits.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from model.config import max_concurrency
from model.engine.kv.block_manager import blocks_for

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_KV_CACHE_BYTES = 4 * GiB
CPU_KVCACHE_ENV = "QKV_CPU_KVCACHE_SPACE"  # GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE
KNOBS = "gpu_memory_utilization, kv_cache_memory_bytes, max_model_len, kv_cache_dtype or quantization"


class DeviceMemory(Protocol):
    """What the profiling run reads of an accelerator's memory (`CudaMemory`; tests give a stand-in)."""

    def total(self) -> int: ...
    def free(self) -> int: ...
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def free(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[0])

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The memory the profiling run measures on `device`; None where the KV cache is sized in bytes
    (the CPU)."""
    return CudaMemory(device) if device.type == "cuda" else None


def cpu_kv_cache_bytes() -> int:
    """The CPU's default KV cache: QKV_CPU_KVCACHE_SPACE GiB when set, else 4 GiB."""
    raw = os.environ.get(CPU_KVCACHE_ENV)
    if raw is None or raw.strip() == "":
        return CPU_KV_CACHE_BYTES
    try:
        gib = float(raw)
    except ValueError:
        raise ValueError(f"{CPU_KVCACHE_ENV} must be a number of GiB, got {raw!r}") from None
    if not gib > 0:
        raise ValueError(f"{CPU_KVCACHE_ENV} must be > 0 GiB, got {raw!r}")
    return int(gib * GiB)


def module_bytes(net: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers (its weights; on any device, `meta` included)."""
    tensors = {id(t): t for t in (*net.parameters(), *net.buffers())}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def gpu_kv_budget(total: int, utilization: float, weights: int, activation_peak: int, free: int | None = None) -> int:
    """Bytes the KV cache gets: `utilization` x `total`, less the weights and the activation peak.
    ValueError naming gpu_memory_utilization when nothing is left, or when the share asked for is
    more than the device has free (another process holds the rest)."""
    share = int(utilization * total)
    budget = share - weights - activation_peak
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {share / GiB:.2f} GiB of the device's "
            f"{total / GiB:.2f} GiB, less than the weights ({weights / GiB:.2f} GiB) and the profiling run's "
            f"activation peak ({activation_peak / GiB:.2f} GiB) need: raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, or quantize the weights")
    if free is not None and budget > free:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {budget / GiB:.2f} GiB of KV cache but only "
            f"{free / GiB:.2f} GiB of the device is free (another process holds "
            f"{(total - free - weights - activation_peak) / GiB:.2f} GiB): lower gpu_memory_utilization or "
            f"set kv_cache_memory_bytes")
    return budget


@dataclass(frozen=True)
class MemoryPlan:
    """The KV cache's size and what it was derived from (the start-up log and `RuntimeInfo` say it)."""

    num_blocks: int
    block_bytes: int
    source: str  # num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization or cpu_default
    weights_bytes: int
    activation_peak_bytes: int = 0  # the profiling run's; 0 where none ran
    total_bytes: int | None = None  # the device's, where it was read

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def plan_blocks(budget: int, block_bytes: int, cap: int, argument: str) -> int:
    """Blocks in `budget` bytes, at most `cap` (what every sequence slot at full length needs)."""
    if budget < block_bytes:
        raise ValueError(f"{argument} leaves {budget} bytes for the KV cache, less than one block "
                         f"({block_bytes} bytes: block_size tokens of every layer's K and V)")
    return min(budget // block_bytes, cap)


def largest_fitting_len(num_blocks: int, block_size: int, window: int | None) -> int | None:
    """The longest sequence `num_blocks` blocks hold; None: any (every layer's attention is windowed,
    so a sequence holds at most its window's blocks and one more)."""
    if window is not None and blocks_for(window, block_size) + 1 <= num_blocks:
        return None
    return num_blocks * block_size


def check_fits(num_blocks: int, block_size: int, max_len: int, window: int | None, plan: MemoryPlan) -> None:
    """ValueError naming max_model_len, the largest value that fits and the knobs, when one
    sequence of `max_len` tokens cannot fit in the cache."""
    fits = largest_fitting_len(num_blocks, block_size, window)
    if fits is None or fits >= max_len:
        return
    raise ValueError(
        f"max_model_len {max_len} does not fit in the KV cache: {num_blocks} blocks of {block_size} tokens "
        f"({plan.kv_cache_bytes / GiB:.2f} GiB, from {plan.source}) hold one sequence of at most {fits} tokens. "
        f"Set max_model_len <= {fits}, or make the cache larger ({KNOBS})")


def describe(plan: MemoryPlan, block_size: int, max_len: int) -> str:
    """The start-up log's line: weights, activation peak, KV cache, maximum concurrency."""
    parts = [f"weights {plan.weights_bytes / GiB:.2f} GiB"]
    if plan.total_bytes is not None:
        parts.append(f"activation peak {plan.activation_peak_bytes / GiB:.2f} GiB (profiling run) of "
                     f"{plan.total_bytes / GiB:.2f} GiB")
    parts.append(f"KV cache {plan.kv_cache_bytes / GiB:.2f} GiB = {plan.num_blocks} blocks of {block_size} tokens "
                 f"({plan.num_blocks * block_size} tokens, from {plan.source})")
    parts.append(f"maximum concurrency at max_model_len {max_len}: "
                 f"{max_concurrency(plan.num_blocks, block_size, max_len):.2f}x")
    return "; ".join(parts)
