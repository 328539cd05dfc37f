"""torch.profiler breakdown of decode steps of a mixture-of-experts model: the MoE layer's share
of the step, and inside it the router, the experts' matmuls, the grouping (sort, bincount and
its host sync, gathers, the per-token sum) and the shared expert; attention beside it.

`moe block` is each SparseMoE call (router, routing, experts, shared expert); `moe experts` is
the Experts call inside it. Both are record_function ranges patched in for the profile only,
like step_profile's `attention`; ops are attributed to the innermost range they run in.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from loadtests.lib.engine_steps import fill
from loadtests.lib.rooflines import sync
from loadtests.lib.step_profile import labelled_ranges
from model.engine.engine import Engine

MOE_RANGES = ("moe block", "moe experts")
RANGES = (*MOE_RANGES, "attention", "kv write")


@contextlib.contextmanager
def moe_ranges() -> Iterator[None]:
    """Wrap SparseMoE.forward and Experts.forward in named profiler ranges."""
    from model.layers.moe import Experts, SparseMoE

    saved = SparseMoE.forward, Experts.forward

    def block(self, *args):
        with record_function("moe block"):
            return saved[0](self, *args)

    def experts(self, *args):
        with record_function("moe experts"):
            return saved[1](self, *args)

    SparseMoE.forward, Experts.forward = block, experts
    try:
        yield
    finally:
        SparseMoE.forward, Experts.forward = saved


def _range_of(event) -> str:
    """The innermost labelled range an op runs in ('' outside all of them)."""
    parent = event.cpu_parent
    while parent is not None and parent.name not in RANGES:
        parent = parent.cpu_parent
    return "" if parent is None else parent.name


def profile_moe_decode(engine: Engine, batch: int, context: int, steps: int = 4) -> dict:
    """Profile `steps` decode steps of `batch` sequences at about `context` tokens; times per step
    in ms: CPU (self, by op) and, on CUDA, device time of the kernels each op launched."""
    fill(engine, batch, context, steps + 2, engine.model_config.vocab_size)
    engine.step()  # warm-up
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled_ranges(), moe_ranges(), profile(activities=activities) as prof:
        sync(engine.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    ranges: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name -> [cpu ms, device ms]
    ops: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for e in prof.events():
        if e.name in RANGES:
            ranges[e.name][0] += e.cpu_time_total / steps / 1e3
            continue
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        where = _range_of(e)
        dev = getattr(e, "self_device_time_total", 0.0) if cuda else 0.0
        entry = ops[(where, e.name)]
        entry[0] += e.self_cpu_time_total / steps / 1e3
        entry[1] += dev / steps / 1e3
        entry[2] += 1 / steps
        if where:
            ranges[where][1] += dev / steps / 1e3
    inside = [{"range": w, "op": n, "self_cpu_ms": c, "self_device_ms": d, "calls": round(k)}
              for (w, n), (c, d, k) in ops.items() if w in MOE_RANGES]
    inside.sort(key=lambda o: o["self_device_ms"] if cuda else o["self_cpu_ms"], reverse=True)
    return {"batch": batch, "context": context, "step_ms": wall * 1e3, "device": str(engine.device),
            "ranges_cpu_ms": {k: v[0] for k, v in ranges.items()},
            "ranges_device_ms": {k: v[1] for k, v in ranges.items()} if cuda else None,
            "moe_ops": inside[:16]}


def print_moe_profile(r: dict) -> None:
    """`profile_moe_decode`'s result as a table."""
    cpu, dev = r["ranges_cpu_ms"], r["ranges_device_ms"]
    print(f"\nMoE decode step, batch {r['batch']}, context ~{r['context']} ({r['device']}): {r['step_ms']:.2f} ms a step")
    for name in ("moe block", "moe experts", "attention"):
        extra = f", device {dev.get(name, 0.0):.2f} ms (self, ops inside)" if dev else ""
        print(f"  {name:<12} {cpu.get(name, 0.0):8.2f} ms CPU wall in range "
              f"({100 * cpu.get(name, 0.0) / r['step_ms']:.0f}% of the step){extra}")
    unit = "self device ms" if dev else "self CPU ms"
    print(f"| {'range':<11} | {'op':<40} | {unit:>14} | {'calls':>5} |\n|{'-' * 13}|{'-' * 42}|{'-' * 16}|{'-' * 7}|")
    for o in r["moe_ops"]:
        value = o["self_device_ms"] if dev else o["self_cpu_ms"]
        print(f"| {o['range']:<11} | {o['op'][:40]:<40} | {value:>14.3f} | {o['calls']:>5} |")
