"""torch.profiler breakdown of steady-state decode steps, and the share of a step spent in
attention over the paged KV cache.

`attention` is the time inside each layer's attention over the cache (the gather and SDPA, or
the fused kernel); `kv write` is storing the step's K/V into the cache. Both are measured as
record_function ranges around those calls, so they include every op they run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from torch.profiler import ProfilerActivity, profile, record_function

from loadtests.lib.engine_steps import fill
from model.engine.engine import Engine
from model.layers.kv_cache import KVCache

RANGES = ("attention", "kv write")


@contextlib.contextmanager
def labelled_ranges() -> Iterator[None]:
    """Wrap the attention-over-cache call and the cache write in named profiler ranges."""
    import model.layers.attention as attention

    owner = next(c for c in vars(attention).values() if isinstance(c, type) and hasattr(c, "_decode"))
    saved = owner._decode, KVCache.update

    def decode(self, *args, **kwargs):
        with record_function("attention"):
            return saved[0](self, *args, **kwargs)

    def update(self, *args, **kwargs):
        with record_function("kv write"):
            return saved[1](self, *args, **kwargs)

    owner._decode, KVCache.update = decode, update
    try:
        yield
    finally:
        owner._decode, KVCache.update = saved


def profile_decode(engine: Engine, batch: int, context: int, steps: int = 8) -> dict:
    """Profile `steps` decode steps of `batch` sequences at about `context` tokens."""
    vocab = engine.model_config.vocab_size
    fill(engine, batch, context, steps + 2, vocab)
    engine.step()  # warm-up
    with labelled_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t0) / steps
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    ranges = {e.key: e.cpu_time_total / steps / 1e3 for e in events if e.key in RANGES}
    ops = sorted((e for e in events if e.key not in RANGES), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in ops) / steps / 1e3
    return {
        "batch": batch, "context": context, "step_ms": wall * 1e3, "profiled_ms": total_self,
        "attention_ms": ranges.get("attention", 0.0), "kv_write_ms": ranges.get("kv write", 0.0),
        "attention_share": ranges.get("attention", 0.0) / total_self if total_self else 0.0,
        "ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / steps / 1e3, "calls": e.count // steps}
                for e in ops[:12]],
    }
