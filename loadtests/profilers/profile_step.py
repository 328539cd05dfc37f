"""Per-op profile of steady-state decode steps (torch.profiler), and the share of a step spent
in attention over the paged KV cache (loadtests/lib/step_profile.py), at each batch and backend;
and the profile of a batch-1 prefill.

    .venv/bin/python loadtests/profilers/profile_step.py [--batch 1,64] [--context 270] [--backend fused,gather]
        [--quantization int8|int4]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.engine_steps import set_backend  # noqa: E402
from loadtests.lib.results import write_json  # noqa: E402
from loadtests.lib.step_profile import RANGES, labelled_ranges, profile_decode  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402


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
    llm = LLM(tmp, dtype=args.dtype, engine_config=EngineConfig(max_num_seqs=64, kv_cache_memory_bytes=3 << 30, **extra))
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
    write_json(args.out, {"load_average_start_end": [load, os.getloadavg()[0]], "runs": results})


if __name__ == "__main__":
    main()
