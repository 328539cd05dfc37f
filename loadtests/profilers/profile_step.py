"""Per-op profile of steady-state decode steps (torch.profiler), and the share of a step spent
in attention over the paged KV cache.

`attention` is the time inside each layer's attention over the cache (the gather and SDPA, or
the fused kernel); `kv write` is storing the step's K/V into the cache. Both are measured as
record_function ranges around those calls, so they include every op they run.

    .venv/bin/python loadtests/profilers/profile_step.py [--batch 1,64] [--context 270] [--backend fused,gather]
        [--quantization int8|int4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.layers.kv_cache import KVCache  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402

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


def fill(engine: Engine, batch: int, context: int, steps: int, vocab: int) -> None:
    """`batch` sequences whose prompts are prefilled, each `context` tokens long."""
    rng = random.Random(batch)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}-{time.monotonic_ns()}", [rng.randrange(vocab) for _ in range(context)],
                           SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True))
    while any(r.seq.num_computed_tokens < context for r in engine._requests.values()):
        engine.step()


def set_backend(engine: Engine, backend: str) -> bool:
    """Switch the runner between the fused kernel and the gather path; False where it has none."""
    runner = engine.runner
    if not hasattr(runner, "fused_decode"):
        return backend == "gather"  # a runner that predates the kernel: the gather path only
    runner.fused_decode = backend == "fused" and runner.fused_available
    return runner.fused_decode == (backend == "fused")


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


def profile_prefill(engine: Engine, length: int, repeats: int = 4) -> dict:
    """Profile the prefill of single `length`-token prompts (one step each, batch 1)."""
    vocab = engine.model_config.vocab_size
    rng = random.Random(length)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", [rng.randrange(vocab) for _ in range(length)], params)
    while engine.has_unfinished():
        engine.step()
    walls = []
    with labelled_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(repeats):
            engine.add_request(f"pf{i}-{time.monotonic_ns()}", [rng.randrange(vocab) for _ in range(length)], params)
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            walls.append(time.perf_counter() - t0)
    events = prof.key_averages()
    ops = sorted((e for e in events if e.key not in RANGES), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self = sum(e.self_cpu_time_total for e in ops) / repeats / 1e3
    best = min(walls)
    return {
        "prompt": length, "step_ms": best * 1e3, "tokens_per_s": length / best, "profiled_ms": total_self,
        "ops": [{"op": e.key, "self_ms": e.self_cpu_time_total / repeats / 1e3, "calls": e.count // repeats}
                for e in ops[:12]],
    }


def print_ops(r: dict) -> None:
    print(f"| {'op':<48} | {'self ms/step':>12} | {'share':>6} | {'calls':>5} |")
    print(f"|{'-' * 50}|{'-' * 14}|{'-' * 8}|{'-' * 7}|")
    for o in r["ops"]:
        print(f"| {o['op'][:48]:<48} | {o['self_ms']:>12.2f} | {100 * o['self_ms'] / r['profiled_ms']:>5.1f}% | {o['calls']:>5} |")


def print_profile(name: str, r: dict) -> None:
    print(f"\n{name}: batch {r['batch']}, context ~{r['context']}: {r['step_ms']:.1f} ms a step, "
          f"attention {r['attention_ms']:.1f} ms ({100 * r['attention_share']:.0f}%), kv write {r['kv_write_ms']:.1f} ms")
    print_ops(r)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-small-random")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--context", type=int, default=270)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=256, help="prompt length of the batch-1 prefill profile (0: none)")
    ap.add_argument("--backend", default="fused,gather")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default=None)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                    help="weights quantized on the fly (the LM head and activations as the defaults pick)")
    ap.add_argument("--out", default="results/profile_step.json")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="qkv-profile-")
    save_model(build_preset(args.preset), tmp)
    extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    extra["quantization"] = args.quantization
    llm = LLM(tmp, dtype=args.dtype, engine_config=EngineConfig(max_num_seqs=64, kv_cache_bytes=3 << 30, **extra))
    results = []
    for backend in args.backend.split(","):
        if not set_backend(llm.engine, backend):
            print(f"backend {backend} is not available here; skipped")
            continue
        for b in map(int, args.batch.split(",")):
            r = profile_decode(llm.engine, b, args.context, args.steps) | {"backend": backend}
            print_profile(backend, r)
            results.append(r)
    if args.prefill:
        r = profile_prefill(llm.engine, args.prefill)
        print(f"\nprefill of one {args.prefill}-token prompt: {r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s")
        print_ops(r)
        results.append(r | {"kind": "prefill"})
    print(f"\n1-minute load average at start/end: {load:.2f} / {os.getloadavg()[0]:.2f} (2 cores), "
          f"{torch.get_num_threads()} torch threads")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"load_average_start_end": [load, os.getloadavg()[0]], "runs": results}, indent=2))


if __name__ == "__main__":
    main()
