"""The engine benchmarks' workload: random token-id prompts and how many tokens each asks for,
the same on every side a benchmark compares (the engine, HF generate, the service)."""

from __future__ import annotations

import random


def workload(n: int, seed: int, vocab: int, max_new: int = 256) -> tuple[list[list[int]], list[int]]:
    """`n` prompts of 32-256 random tokens, each asking for 16-`max_new` tokens (uniform)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 256))] for _ in range(n)]
    return prompts, [rng.randint(min(16, max_new), max_new) for _ in range(n)]
