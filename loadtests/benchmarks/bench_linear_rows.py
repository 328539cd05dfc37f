"""One layer stack's dense products for M rows: `F.linear` against `model.layers.linear.dense.linear`
(the transposed product that small row counts take on the CPU).

The weights are a whole model's worth of the paper's base shape (6 layers of Q/K/V 512x1536, output
512x512, FFN 512x2048 and 2048x512: 76 MB in float32), cycled through in order, so each product
reads its weight from memory as a decode step does, not from a warm cache. For each M, both forms
run in turn, and the median of `--repeats` passes is kept. Prints a table and the rows where the
transposed form is at least 5% faster (what `SMALL_ROWS_MIN/MAX` should cover); writes JSON.

`--engine MODEL` times the engine's own decode step instead: B sequences of a 64-token context,
one forward over B rows (the runner's `run`, sampling included), with the transposed product off
(every row count through `F.linear`, as before it existed) and on, in turn, median of `--repeats`.

    .venv/bin/python loadtests/benchmarks/bench_linear_rows.py --threads 2 --out linear_rows.json
    .venv/bin/python loadtests/benchmarks/bench_linear_rows.py --engine transformer-base-trained --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.layers.linear import dense  # noqa: E402


def shapes(d_model: int, d_ff: int, layers: int) -> list[tuple[int, int]]:
    """(in, out) of each projection of a paper-Transformer stack, in forward order."""
    return [(d_model, 3 * d_model), (d_model, d_model), (d_model, d_ff), (d_ff, d_model)] * layers


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
    from loadtests.profilers.profile_step import fill

    from model.config import EngineConfig
    from model.engine.engine import Engine
    from model.engine.scheduler import ScheduledSeq

    forced = (dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX)
    rows = []
    print(f"{'batch':>5} {'F.linear ms':>12} {'transposed ms':>14} {'ratio':>6}")
    for b in args.rows:
        eng = Engine(args.engine, EngineConfig(max_num_seqs=max(b, 8)), dtype="float32")
        fill(eng, b, 64, 96, eng.model_config.vocab_size)
        seqs = list(eng.scheduler.running)
        for s in seqs:  # the next token's block, as the scheduler would grow it
            eng.scheduler.blocks.grow(s, s.num_computed_tokens + 1)
        step = [ScheduledSeq(s, 1) for s in seqs]
        samples: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.repeats + 2):
            for mode in ("off", "on"):  # in turn: drift hits both alike
                dense.SMALL_ROWS_MAX = 1 if mode == "off" else forced[1]
                t0 = time.perf_counter()
                eng.runner.run(step, [eng._row(s) for s in seqs])
                if r >= 2:  # the first two: warm-up
                    samples[mode].append(time.perf_counter() - t0)
        dense.SMALL_ROWS_MAX = forced[1]
        off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
        rows.append({"batch": b, "f_linear_ms": off * 1e3, "transposed_ms": on * 1e3, "ratio": on / off})
        print(f"{b:5} {off * 1e3:12.2f} {on * 1e3:14.2f} {on / off:6.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17, 24, 32])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--engine", default=None, help="a model: time its engine's decode step instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        if args.rows == ap.get_default("rows"):
            args.rows = [1, 2, 3, 4, 8, 16, 32]
        rows = engine_steps(args)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "engine_steps": rows}, indent=2) + "\n")
            print(f"wrote {args.out}")
        return
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(o, i, generator=gen), torch.randn(o, generator=gen))
               for i, o in shapes(args.d_model, args.d_ff, args.layers)]
    forced = (dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX)
    dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX = 1, 1 << 30  # time the transposed form at every M

    rows = []
    one = None
    print(f"{'rows':>5} {'F.linear ms':>12} {'transposed ms':>14} {'ratio':>6} {'F.linear / 1 row':>17}")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {i for i, _ in shapes(args.d_model, args.d_ff, 1)}}
        base = time_pass(F.linear, weights, xs, args.repeats)
        trans = time_pass(dense.linear, weights, xs, args.repeats)
        one = one or base
        rows.append({"rows": m, "f_linear_ms": base * 1e3, "transposed_ms": trans * 1e3, "ratio": trans / base})
        print(f"{m:5} {base * 1e3:12.2f} {trans * 1e3:14.2f} {trans / base:6.2f} {base / one:17.2f}", flush=True)
    dense.SMALL_ROWS_MIN, dense.SMALL_ROWS_MAX = forced
    pays = [r["rows"] for r in rows if r["ratio"] < 0.95]
    print(f"transposed form >= 5% faster at rows {pays}; the layer uses it for "
          f"{forced[0]}..{forced[1]} rows")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
