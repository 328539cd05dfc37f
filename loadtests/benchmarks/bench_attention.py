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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

H, D = 8, 64


def measure(impl: str, n: int, mode: str, repeats: int) -> dict:
    """Runs in the child: time and peak extra memory of one attention call."""
    import torch

    from model.layers.attention import AdditiveScore, DotScore

    torch.manual_seed(0)
    score = AdditiveScore(H, D) if impl == "additive" else DotScore(D)
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
    add_result_args(ap, "results/bench_attention.json")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        impl, n, mode, repeats = args.child
        print(json.dumps(measure(impl, int(n), mode, int(repeats))))
        return
    import torch

    rows, table = [], []
    print(f"attention core, h={H}, d_k={D}, batch 1, {torch.get_num_threads()} threads, best of {args.repeats} "
          "(shared machine: the minimum is the least noisy)")
    for n in args.lengths:
        for mode in ("forward", "decode"):
            dot = run_child("dot", n, mode, args.repeats)
            add = run_child("additive", n, mode, max(1, args.repeats if n <= 512 else 2))
            rows += [dot, add]
            table.append([str(n), mode, f"{dot['ms']:.3f}", f"{add['ms']:.3f}", f"{add['ms'] / dot['ms']:.1f}x",
                          f"{dot['peak_extra_mib']:.1f}", f"{add['peak_extra_mib']:.1f}"])
    columns = ["n", "mode", "dot ms", "additive ms", "ratio", "dot MiB", "additive MiB"]
    print_table(columns, table)
    if args.out:
        write_result(args.out, "bench_attention", columns, table, note=args.note,
                     raw={"rows": rows, "threads": torch.get_num_threads()},
                     title=f"Attention core, dot-product against additive (h={H}, d_k={D}, batch 1)")

if __name__ == "__main__":
    main()
