"""The compiled CPU decode step (`enforce_eager=False`: torch.compile over static padded buffers,
the project's kernels as custom ops) against the eager step (`enforce_eager=True`).

For each shape and weight scheme, engines on the same random checkpoint (the eager one and one
compiled engine per Inductor variant asked for); llama-batched-bench's generation rows (128-token
prompts, then decode steps) at 1 and 16 sequences, the engines taking turns round after round so
that the machine's drift falls on all. The ratio is compiled / eager decode tokens per second
(median of the rounds). Each compiled engine's start-up compile time is reported too (Inductor's
cache directory is a fresh one per run unless --warm-cache). Last, the start of make serve's default
model in a fresh process, to a ready engine: eager, compiled with an empty cache, compiled again.

    .venv/bin/python loadtests/benchmarks/bench_compiled_step.py --out docs/results/bench_compiled_step.json
    .venv/bin/python loadtests/benchmarks/bench_compiled_step.py --quick   # a tiny Llama shape: checks it runs
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtests.lib.checkpoints import PRESET, checkpoint  # noqa: E402
from loadtests.lib.llama_cpp import Workload, alternating_rates, engine_config  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM  # noqa: E402

SHAPES = (PRESET, "qwen2.5-0.5b-shape")
# float32; int8 as the engine runs it by default on an AVX-512 VNNI CPU: int8 LM head, int8 activations.
SCHEMES = {"float32": "float32", "int8": "int8+head8+a8"}
# Inductor options tried for the compiled step (the engine compiles with the defaults).
VARIANTS = {"default": {}, "cpp_wrapper": {"cpp_wrapper": True}, "freezing": {"freezing": True}}


def run_scheme(source: str, shape: str, scheme: str, args: argparse.Namespace, cache_dir: str) -> list[dict]:
    work = (Workload("generation", 128, args.steps, tuple(args.batches)),)
    config = engine_config(SCHEMES[scheme], work, args.group)
    engines = {"eager": LLM(source, device="cpu", dtype="float32", engine_config=config, enforce_eager=True)}
    compile_s, compiles = {}, {}
    for variant in args.variants:
        with torch._inductor.config.patch(VARIANTS[variant]):  # read while the engine compiles, at start-up
            llm = LLM(source, device="cpu", dtype="float32", engine_config=config, enforce_eager=False,
                      compile_cache_dir=f"{cache_dir}-{variant}" if cache_dir else None)
        graphs = llm.engine.runner.graphs
        if graphs is None or graphs.compiled is None:
            raise SystemExit(f"the compiled engine decodes eagerly: {graphs and graphs.eager_reason}")
        engines[variant], compile_s[variant] = llm, llm.engine.runtime.startup_seconds["compile"]
        print(f"  {shape} {scheme} {variant}: compiled at start-up in {compile_s[variant]:.1f} s", flush=True)
    rates = alternating_rates(engines, args.batches, args.rounds, args.steps)
    for variant in args.variants:  # recompiles after start-up would show here (none expected)
        compiles[variant] = engines[variant].engine.runner.graphs.num_compiles
    del engines
    gc.collect()
    rows = []
    for b in args.batches:
        eager = statistics.median(rates["eager", b])
        for variant in args.variants:
            compiled = statistics.median(rates[variant, b])
            rows.append({"shape": shape, "scheme": scheme, "variant": variant, "batch": b, "compiled_tok_s": compiled,
                         "eager_tok_s": eager, "ratio": compiled / eager, "compile_s": compile_s[variant],
                         "num_compiles": compiles[variant],
                         "rounds": {"compiled": rates[variant, b], "eager": rates["eager", b]}})
            print(f"  {shape} {scheme} {variant} b{b}: compiled {compiled:.1f}, eager {eager:.1f} tok/s "
                  f"({compiled / eager:.3f}x)", flush=True)
    return rows


# One engine start in a fresh process: imports, load, KV cache, and (compiled) the start-up compile.
START = """
import sys
from model import LLM
LLM(sys.argv[1], device="cpu", dtype="float32", enforce_eager=sys.argv[2] == "eager", compile_cache_dir=sys.argv[3])
"""


def startup_rows(model: str, tmp: str, repeats: int) -> list[dict]:
    """Seconds from process start to a ready engine of `model`, as a user starts it: eager, compiled
    with an empty compile cache (cold), and compiled again with that cache (warm); the median of
    `repeats` starts each (a cold start gets a fresh cache every time)."""
    def start(mode: str, cache: str) -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", START, model, mode, cache], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"eager": [], "compiled, cold cache": [], "compiled, warm cache": []}
    for i in range(repeats):
        cache = str(Path(tmp) / f"start-cache-{i}")
        times["eager"].append(start("eager", cache))
        times["compiled, cold cache"].append(start("compiled", cache))
        times["compiled, warm cache"].append(start("compiled", cache))
    eager = statistics.median(times["eager"])
    rows = [{"model": model, "start": k, "seconds": statistics.median(v), "vs_eager": statistics.median(v) / eager,
             "runs": v} for k, v in times.items()]
    for r in rows:
        print(f"  start of {model}, {r['start']}: {r['seconds']:.1f} s ({r['vs_eager']:.2f}x eager)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--group", type=int, default=128, help="the int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS),
                    help="Inductor options of the compiled engines (one engine each, all in the same rounds)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="use the engine's default compile cache (a warm start) instead of a fresh one")
    ap.add_argument("--start-model", default="transformer-base-trained",
                    help="the model whose start-up is timed (make serve's default); '' skips it")
    ap.add_argument("--start-repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="the tiny Llama shape, float32, one round")
    add_result_args(ap, "results/bench_compiled_step.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.schemes, args.rounds, args.steps = ["tiny-llama-shape"], ["float32"], 1, 8
        args.start_model, args.start_repeats = "transformer-base", 1
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            ckpt = Path(tmp) / shape
            checkpoint(shape, str(ckpt))
            for scheme in args.schemes:
                cache_dir = None if args.warm_cache else str(Path(tmp) / f"inductor-{shape}-{scheme}")
                rows += run_scheme(str(ckpt), shape, scheme, args, cache_dir)
            for f in ckpt.glob("*.safetensors"):
                f.unlink()
        starts = startup_rows(args.start_model, tmp, args.start_repeats) if args.start_model else []
    columns = ["shape", "scheme", "Inductor", "sequences", "compiled tok/s", "eager tok/s", "compiled / eager",
               "compile s"]
    table = [[r["shape"], r["scheme"], r["variant"], r["batch"], f"{r['compiled_tok_s']:.1f}", f"{r['eager_tok_s']:.1f}",
              f"{r['ratio']:.3f}", f"{r['compile_s']:.1f}"] for r in rows]
    for r in starts:
        table.append([r["model"], "start-up", r["start"], "", "", "", f"{r['vs_eager']:.2f}x eager",
                      f"{r['seconds']:.1f} s start"])
    print_table(columns, table)
    if args.out:
        write_result(args.out, "bench_compiled_step", columns, table,
                     raw={"threads": args.threads, "steps": args.steps, "rounds": args.rounds, "variants": args.variants,
                          "warm_cache": args.warm_cache, "rows": rows, "starts": starts},
                     note=args.note, title="The compiled decode step against the eager step "
                                           "(decode tokens/s, 128-token prompts)")


if __name__ == "__main__":
    main()
