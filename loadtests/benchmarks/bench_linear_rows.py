"""One layer stack's dense float32 products for M rows, three ways: `F.linear` (MKL), the
transposed product `(W @ x^T)^T` and the project's dense kernel (`model/layers/linear/dense.py`
picks between the last two by M).

The weights are a whole model's worth of a shape (`--shape gpt2-small`: 12 layers of Q/K/V
768x2304, output 768x768, FFN 768x3072 and 3072x768, and the 50257x768 LM head, 498 MB in
float32; `transformer-base`: the paper's 6 layers of 512-wide, 76 MB), cycled through in order,
so each product reads its weight from memory as a decode step does, not from a warm cache. For
each M the three forms run in turn, and the median of `--repeats` passes is kept.

`--engine MODEL` times the engine's own decode step instead: B sequences of a 64-token context,
one forward over B rows (the runner's `run`, sampling included), through F.linear only, with the
transposed product, and with the kernel, in turn, median of `--repeats`.

    .venv/bin/python loadtests/benchmarks/bench_linear_rows.py --out docs/results/bench_linear_rows.json
    .venv/bin/python loadtests/benchmarks/bench_linear_rows.py --engine transformer-base-trained
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.layers.linear import dense  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

SHAPES = {"gpt2-small": (768, 3072, 12, 50257), "transformer-base": (512, 2048, 6, 0)}  # d_model, d_ff, N, head
FORMS = ("F.linear", "transposed", "kernel")


def shapes(d_model: int, d_ff: int, layers: int, head: int = 0) -> list[tuple[int, int]]:
    """(in, out) of each projection of a paper-Transformer stack, in forward order, then the head's."""
    return [(d_model, 3 * d_model), (d_model, d_model), (d_model, d_ff), (d_ff, d_model)] * layers + (
        [(d_model, head)] if head else [])


def select(name: str) -> None:
    """Make dense.linear take `name`'s path at every M."""
    dense.set_kernel(name == "kernel")
    dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX = (1, 1 << 30) if name == "transposed" else (2, 0)
    dense.KERNEL_MAX_ROWS = 1 << 30


def time_pass(fn, weights: list[tuple[torch.Tensor, torch.Tensor]], xs: dict[int, torch.Tensor], repeats: int) -> float:
    for _ in range(2):
        for w, b in weights:
            fn(xs[w.shape[1]], w, b)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w, b in weights:
            fn(xs[w.shape[1]], w, b)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def engine_steps(args) -> list[dict]:
    """Decode-step time of `args.engine` at each batch size, the transposed product off and on."""
    from loadtests.lib.engine_steps import fill

    from model.config import EngineConfig
    from model.engine.builder import build_engine
    from model.engine.scheduler import ScheduledSeq

    forced = (dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX, dense.KERNEL_MAX_ROWS)
    rows = []
    print(f"{'batch':>5} " + " ".join(f"{f + ' ms':>14}" for f in FORMS))
    for b in args.rows:
        eng = build_engine(args.engine, EngineConfig(max_num_seqs=max(b, 8)), dtype="float32")
        fill(eng, b, 64, 96, eng.model_config.vocab_size)
        seqs = list(eng.scheduler.running)
        for s in seqs:  # the next token's block, as the scheduler would grow it
            eng.scheduler.blocks.grow(s, s.num_computed_tokens + 1)
        step = [ScheduledSeq(s, 1) for s in seqs]
        samples: dict[str, list[float]] = {f: [] for f in FORMS}
        for r in range(args.repeats + 2):
            for name in FORMS:  # in turn: drift hits all alike
                select(name)
                t0 = time.perf_counter()
                eng.runner.run(step, [eng._row(s) for s in seqs])
                if r >= 2:  # the first two: warm-up
                    samples[name].append(time.perf_counter() - t0)
        row = {"batch": b, **{f"{f}_ms": statistics.median(samples[f]) * 1e3 for f in FORMS}}
        rows.append(row)
        print(f"{b:5} " + " ".join(f"{row[f + '_ms']:14.2f}" for f in FORMS), flush=True)
    dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX, dense.KERNEL_MAX_ROWS = forced
    dense.set_kernel(None)
    return rows


def table(rows: list[dict], key: str) -> tuple[list[str], list[list[str]]]:
    columns = [key, *(f"{f} ms" for f in FORMS), "kernel / F.linear", "kernel / transposed"]
    return columns, [[str(r[key]), *(f"{r[f + '_ms']:.2f}" for f in FORMS),
                      f"{r['kernel_ms'] / r['F.linear_ms']:.2f}", f"{r['kernel_ms'] / r['transposed_ms']:.2f}"]
                     for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--shape", default="gpt2-small", choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--engine", default=None, help="a model: time its engine's decode step instead")
    add_result_args(ap, None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not dense.kernel_available():
        sys.exit("the dense kernel did not build here: nothing to compare")
    if args.engine:
        if args.rows == ap.get_default("rows"):
            args.rows = [1, 2, 4, 8, 16, 32]
        rows = engine_steps(args)
        columns, cells = table(rows, "batch")
        title = f"{args.engine}: decode step by product form"
    else:
        gen = torch.Generator().manual_seed(0)
        weights = [(torch.randn(o, i, generator=gen) * 0.02, torch.randn(o, generator=gen))
                   for i, o in shapes(*SHAPES[args.shape])]
        nbytes = sum(w.numel() * 4 for w, _ in weights)
        forced = (dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX, dense.KERNEL_MAX_ROWS)
        rows = []
        with torch.inference_mode():
            for m in args.rows:
                xs = {k: torch.randn(m, k, generator=gen) for k in {w.shape[1] for w, _ in weights}}
                row: dict = {"rows": m}
                for name in FORMS:
                    select(name)
                    row[f"{name}_ms"] = time_pass(F.linear if name == "F.linear" else dense.linear, weights, xs, args.repeats if m <= 128 else 3) * 1e3
                row["kernel_gb_s"] = nbytes / row["kernel_ms"] / 1e6
                row["F.linear_gb_s"] = nbytes / row["F.linear_ms"] / 1e6
                rows.append(row)
                print(f"{m:5} " + " ".join(f"{row[f + '_ms']:10.2f}" for f in FORMS), flush=True)
        dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX, dense.KERNEL_MAX_ROWS = forced
        dense.set_kernel(None)
        columns, cells = table(rows, "rows")
        title = f"Dense float32 products of {args.shape}'s weights ({nbytes / 2**20:.0f} MiB) by rows"
    print_table(columns, cells)
    if args.out:
        write_result(args.out, "bench_linear_rows", columns, cells, raw={"args": vars(args), "rows": rows},
                     note=args.note, title=title)


if __name__ == "__main__":
    main()
