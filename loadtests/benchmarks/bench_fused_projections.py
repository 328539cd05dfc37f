"""Fused projections (q/k/v and gate/up as one product each) against the same model unfused.

For each shape and weight scheme, two engines on the same random checkpoint, one loaded as the
engine loads it (projections fused, model/layers/linear/fuse.py) and one with the fusion left
out; llama-batched-bench's generation rows (128-token prompts, then decode steps) at 1 and 16
sequences, the two engines taking turns round after round so that the machine's drift falls on
both. The ratio is fused / unfused tokens per second (median of the rounds).

    .venv/bin/python loadtests/benchmarks/bench_fused_projections.py --out docs/results/bench_fused_projections.json
    .venv/bin/python loadtests/benchmarks/bench_fused_projections.py --quick   # a tiny Llama shape: checks it runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import checkpoint  # noqa: E402
from loadtests.lib.llama_cpp import Workload, alternating_rates, engine_config  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM  # noqa: E402
from model.engine import builder  # noqa: E402

SHAPES = ("qwen2.5-0.5b-shape", "llama3.2-1b-shape")
SCHEMES = ("float32", "int8", "int4")


def load(source: str, scheme: str, work: tuple[Workload, ...], group: int, fused: bool) -> LLM:
    """The engine as it loads (fused), or with `fuse_projections` left out of its build."""
    config = engine_config(scheme, work, group)
    if fused:
        return LLM(source, device="cpu", dtype="float32", engine_config=config)
    with mock.patch.object(builder, "fuse_projections", lambda net: 0):
        return LLM(source, device="cpu", dtype="float32", engine_config=config)


def run_scheme(source: str, shape: str, scheme: str, args: argparse.Namespace) -> list[dict]:
    work = (Workload("generation", 128, args.steps, tuple(args.batches)),)
    engines = {"fused": load(source, scheme, work, args.group, True),
               "unfused": load(source, scheme, work, args.group, False)}
    rates = alternating_rates(engines, args.batches, args.rounds, args.steps)
    del engines
    gc.collect()
    rows = []
    for b in args.batches:
        fused, unfused = (statistics.median(rates[k, b]) for k in ("fused", "unfused"))
        rows.append({"shape": shape, "scheme": scheme, "batch": b, "fused_tok_s": fused, "unfused_tok_s": unfused,
                     "ratio": fused / unfused, "rounds": {k: rates[k, b] for k in ("fused", "unfused")}})
        print(f"  {shape} {scheme} b{b}: fused {fused:.1f}, unfused {unfused:.1f} tok/s ({fused / unfused:.3f}x)",
              flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--group", type=int, default=128, help="the int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the tiny Llama shape, float32, one round")
    add_result_args(ap, "results/bench_fused_projections.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.schemes, args.rounds, args.steps = ["tiny-llama-shape"], ["float32"], 1, 8
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            ckpt = Path(tmp) / shape
            checkpoint(shape, str(ckpt))
            for scheme in args.schemes:
                rows += run_scheme(str(ckpt), shape, scheme, args)
            for f in ckpt.glob("*.safetensors"):
                f.unlink()
    columns = ["shape", "scheme", "sequences", "fused tok/s", "unfused tok/s", "fused / unfused"]
    table = [[r["shape"], r["scheme"], r["batch"], f"{r['fused_tok_s']:.1f}", f"{r['unfused_tok_s']:.1f}",
              f"{r['ratio']:.3f}"] for r in rows]
    print_table(columns, table)
    if args.out:
        write_result(args.out, "bench_fused_projections", columns, table,
                     raw={"threads": args.threads, "steps": args.steps, "rounds": args.rounds, "rows": rows},
                     note=args.note, title="Fused q/k/v and gate/up projections against the unfused model "
                                           "(decode tokens/s, 128-token prompts)")


if __name__ == "__main__":
    main()
