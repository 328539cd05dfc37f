"""Catch device mixes without a GPU: the engine on torch's `meta` device.

A GPU run fails where a CUDA tensor meets a CPU tensor of one or more dimensions in one op;
this CPU-only build cannot make a CUDA tensor, even a fake one (`FakeTensorMode` with a CUDA
device raises "not linked with support for cuda devices" on `torch.tensor(data, device=...)`).
Tensors on the `meta` device follow the same rule (an op mixing in a CPU tensor raises "Tensor
on device cpu is not on the expected device meta!"), carry shapes and dtypes but no data, and
so stand in for the accelerator: the engine is built with its device resolved to `meta`, and
`HostReads` answers each host read of a meta tensor (`tolist`, `item`, `bool`, `int`, `float`, `cpu`)
with ones of its shape, so a step runs to its end (every sampled token is 1) through the same
code a CUDA step runs.

FlexAttention refuses meta tensors, so on meta the flex backend's kernel is a stand-in
(`_flex_on_meta`) that checks what the kernel would read is on the query's device: the pool,
the block mask's tables, and the tensors its `mask_mod` closes over (it evaluates the mask_mod
on meta indices), then returns an empty output of the right shape.

What it cannot see: a CPU generator handed to a CUDA op (meta has no generators, so seeded
requests are left out), and kernels that exist only on one device (the fused CPU kernels are
not chosen on meta).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

META = torch.device("meta")


def _filled(t: torch.Tensor) -> torch.Tensor:
    """What a host read of meta tensor `t` sees: ones (token id 1, not the tiny models' eos 0),
    False for booleans."""
    return torch.zeros(t.shape, dtype=t.dtype) if t.dtype == torch.bool else torch.ones(t.shape, dtype=t.dtype)


_READS = {
    torch.Tensor.tolist: lambda t: _filled(t).tolist(),
    torch.Tensor.item: lambda t: _filled(t).item(),
    torch.Tensor.__bool__: lambda t: False,
    torch.Tensor.__int__: lambda t: 1,
    torch.Tensor.__index__: lambda t: 1,
    torch.Tensor.__float__: lambda t: 1.0,
    torch.Tensor.cpu: _filled,  # a copy to the host (attention maps come back this way)
}
# In-place ops whose operands must share self's device on CUDA; meta checks out-of-place ops
# only, so these are checked here. copy_ (and slice assignment, which is copy_) may cross devices.
_IN_PLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__", "__ixor__"}
_CROSS_DEVICE_OK = {"copy_", "set_", "__setitem__"}


def _tensors(values: Any) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def _check_in_place(func: Any, args: tuple, kwargs: dict) -> None:
    name = getattr(func, "__name__", "")
    if not (name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))) or name in _CROSS_DEVICE_OK:
        return
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type != "meta":
        return
    for t in _tensors([*args[1:], *kwargs.values()]):
        if t.dim() > 0 and t.device != args[0].device:
            raise RuntimeError(f"{name}: Tensor on device {t.device} is not on the expected device meta!")


class HostReads(TorchFunctionMode):
    """Answers host reads of meta tensors (counted in `reads`) and checks the devices of in-place
    ops on them; every other op runs as is (meta checks its own devices)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        answer = _READS.get(func)
        if answer is not None and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            self.reads += 1
            return answer(args[0])
        _check_in_place(func, args, kwargs)
        return func(*args, **kwargs)


def _flex_on_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any = None, scale: float | None = None,
                  enable_gqa: bool = False, kernel_options: Any = None) -> torch.Tensor:
    """flex_attention's shapes and device checks on meta: q (B, Hq, Lq, d) -> (B, Hq, Lq, d_v)."""
    tables = (block_mask.kv_num_blocks, block_mask.kv_indices) if block_mask is not None else ()
    for t in (k, v, *tables):
        if t.device != q.device:
            raise RuntimeError(f"Tensor on device {t.device} is not on the expected device {q.device}!")
    if block_mask is not None:
        b, lq, lk = q.shape[0], q.shape[2], k.shape[2]
        idx = [torch.arange(n, device=q.device) for n in (b, 1, lq, lk)]
        block_mask.mask_mod(idx[0].view(-1, 1, 1, 1), idx[1].view(1, -1, 1, 1), idx[2].view(1, 1, -1, 1),
                            idx[3].view(1, 1, 1, -1))
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@contextlib.contextmanager
def engine_on_meta(monkeypatch) -> Iterator[HostReads]:
    """Inside: `build_engine(..., device="cuda")` builds on the meta device (the KV cache sized by
    `num_kv_blocks` or `kv_cache_memory_bytes`, which the caller sets), and its steps run under
    `HostReads`."""
    import model.engine.builder as builder_mod
    import model.engine.spec_decode.draft as draft_mod
    import model.layers.flex_attention as flex_mod

    def resolve(device: str) -> torch.device:
        return META

    monkeypatch.setattr(builder_mod, "resolve_device", resolve)
    if hasattr(draft_mod, "resolve_device"):
        monkeypatch.setattr(draft_mod, "resolve_device", resolve)
    monkeypatch.setattr(flex_mod, "flex_attention", _flex_on_meta)
    with HostReads() as mode:
        yield mode


class FakeDeviceMemory:
    """A GPU's memory as `model.engine.memory.DeviceMemory` reads it, for an engine on meta: a
    device of `total` bytes (`free` of them free, default all), on which the profiling run's
    forward pass peaks `activation_peak` bytes above what was allocated before it. Meta tensors
    take no memory, so the peak is the caller's figure; what is checked is the arithmetic and that
    the profiling run ran (`profiled`)."""

    def __init__(self, total: int, activation_peak: int, free: int | None = None) -> None:
        self._total, self._free, self.activation_peak = total, total if free is None else free, activation_peak
        self.profiled = 0  # profiling runs (peak resets) seen

    def total(self) -> int:
        return self._total

    def free(self) -> int:
        return self._free

    def allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        self.profiled += 1

    def peak(self) -> int:
        return self.activation_peak


@contextlib.contextmanager
def gpu_memory_on_meta(monkeypatch, memory: FakeDeviceMemory) -> Iterator[FakeDeviceMemory]:
    """Inside `engine_on_meta`: the meta device sizes its KV cache as CUDA does, by a profiling run
    and `gpu_memory_utilization` of `memory`."""
    import model.engine.builder as builder_mod

    monkeypatch.setattr(builder_mod, "device_memory", lambda device: memory if device.type == "meta" else None)
    yield memory
