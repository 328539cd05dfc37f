"""Dot-product vs additive attention at the paper's shapes (d_model 512, h 8, d_k 64).

For each context length n: the forward pass over n tokens (causal, as in a prefill) and one
decode step (one query against n cached keys), time and peak extra memory. Each measurement
runs in a fresh subprocess so that its peak RSS is its own.

    .venv/bin/python loadtests/benchmarks/bench_attention.py [--lengths 128 512 2048] [--out results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

H, D = 8, 64


def measure(impl: str, n: int, mode: str, repeats: int) -> dict:
    """Runs in the child: time and peak extra memory of one attention call."""
    import torch

    from model.layers.attention import AdditiveScore, DotScore

    torch.manual_seed(0)
    score = AdditiveScore(H, D) if impl == "additive" else DotScore()
    for p in score.parameters():
        torch.nn.init.normal_(p, std=D**-0.5)
    lq = n if mode == "forward" else 1
    q, k, v = torch.randn(1, H, lq, D), torch.randn(1, H, n, D), torch.randn(1, H, n, D)
    offset = 0 if mode == "forward" else None  # forward is causal; decode sees every cached key
    with torch.inference_mode():
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(3):  # warm-up: thread pool and allocator
            score.attend(q, k, v, causal_offset=offset)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            score.attend(q, k, v, causal_offset=offset)
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"impl": impl, "n": n, "mode": mode, "ms": 1e3 * min(times),
            "peak_extra_mib": max(0, peak - base) / 1024}


def run_child(impl: str, n: int, mode: str, repeats: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", impl, str(n), mode, str(repeats)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/bench_attention.json")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, n, mode, repeats = args.child
        print(json.dumps(measure(impl, int(n), mode, int(repeats))))
        return
    import torch

    rows = []
    print(f"attention core, h={H}, d_k={D}, batch 1, {torch.get_num_threads()} threads, best of {args.repeats} (shared machine: the minimum is the least noisy)")
    print(f"{'n':>6} {'mode':>8} | {'dot ms':>9} {'additive ms':>12} {'ratio':>7} | {'dot MiB':>8} {'additive MiB':>13}")
    for n in args.lengths:
        for mode in ("forward", "decode"):
            dot = run_child("dot", n, mode, args.repeats)
            add = run_child("additive", n, mode, max(1, args.repeats if n <= 512 else 2))
            rows += [dot, add]
            print(f"{n:>6} {mode:>8} | {dot['ms']:>9.3f} {add['ms']:>12.3f} {add['ms'] / dot['ms']:>6.1f}x | "
                  f"{dot['peak_extra_mib']:>8.1f} {add['peak_extra_mib']:>13.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "threads": torch.get_num_threads()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
