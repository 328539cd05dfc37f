"""Driving an `Engine` step by step, as the benchmarks and profilers do: a batch of prefilled
sequences, steady-state decode rates, the attention path of the decode steps."""

from __future__ import annotations

import random
import time

from loadtests.lib.rooflines import sync
from model import LLM, SamplingParams
from model.engine.engine import Engine


def fill(engine: Engine, batch: int, context: int, steps: int, vocab: int) -> None:
    """`batch` sequences whose prompts are prefilled, each `context` tokens long, each asking for
    `steps` + 4 tokens."""
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}-{time.monotonic_ns()}", [rng.randrange(vocab) for _ in range(context)],
                           SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    while any(r.seq.num_computed_tokens < context for r in engine._requests.values()):
        engine.step()


def decode_rate(llm: LLM, batch: int, vocab: int, steps: int = 32) -> float:
    """Steady-state decode tokens/s with `batch` sequences of 128-token prompts."""
    engine = llm.engine
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", [rng.randrange(vocab) for _ in range(128)],
                           SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while any(r.seq.num_computed_tokens < 128 for r in engine._requests.values()):
        engine.step()  # prefill
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    secs = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return batch * steps / secs


def set_backend(engine: Engine, backend: str) -> bool:
    """Switch the runner between the fused kernel and the gather path; False where it has none."""
    runner = engine.runner
    if not hasattr(runner, "fused_decode"):
        return backend == "gather"  # a runner that predates the kernel: the gather path only
    runner.fused_decode = backend == "fused" and runner.fused_available
    return runner.fused_decode == (backend == "fused")
