"""The engine against llama.cpp on this CPU, back to back on the same weights, in one run.

llama.cpp is built from the tree vendored in the `llama-cpp-python` sdist on PyPI (cmake,
`-DGGML_NATIVE=ON`, llama-batched-bench and llama-quantize only; about 20 minutes on 2 cores the
first time, then cached under `--cache`). Each shape is a random checkpoint (GPT-2 small: the
preset's layout; Qwen2.5-0.5B and Llama-3.2-1B: loadtests/lib/checkpoints.py) with a
small byte-level BPE tokenizer, converted to an f32 GGUF by llama.cpp's own convert_hf_to_gguf.py
and quantized by llama-quantize (Q8_0, Q4_0, Q4_K_M).

Both engines run llama-batched-bench's workload with 2 threads: `npl` sequences of `npp` random
prompt tokens prefilled together (prefill tok/s: npl * npp over the time to every first
logit), then `ntg` decode steps of all `npl` sequences (generation tok/s: npl * ntg over their
time). The engine side steps `LLM.engine` directly, prefix caching off (llama-batched-bench
clears its cache between rows), as loadtests/lib/engine_steps.py's decode_rate does. Pairs: f32 with the
engine's float32, Q8_0 with int8 (per output channel), Q4_0 (groups of 32) and Q4_K_M with int4
(groups of `--group`, the LM head float as by default) and Q4_0 again with int4+head (the
head quantized too: llama-quantize writes a Q6_K output tensor in its Q4 files).

    .venv/bin/python loadtests/benchmarks/bench_llama_cpp.py --out docs/results/bench_llama_cpp.json
    .venv/bin/python loadtests/benchmarks/bench_llama_cpp.py --quick   # a tiny Llama shape: checks it runs
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import PRESET as GPT2_PRESET, checkpoint  # noqa: E402
from loadtests.lib.llama_cpp import (CMAKE_FLAGS, LLAMA_CPP_PYTHON, Workload, build_llama_cpp, convert,  # noqa: E402
                                     engine_batched_bench, engine_config, llama_cpp_tree, run_llama_cpp)
from loadtests.lib.provenance import cpu_model  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM  # noqa: E402

# shape -> (source, workloads). Llama-3.2-1B runs fewer rows: its 16-prompt prefill alone is minutes a side
# Batch 1 decodes 128 tokens: 32 (well under a second) varied by a third between two runs of llama.cpp.
SHAPE_RUNS: dict[str, tuple[str, tuple[Workload, ...]]] = {
    "gpt2-small": (GPT2_PRESET, (Workload("generation", 128, 128, (1,)), Workload("generation", 128, 32, (16, 64)),
                                 Workload("prefill", 512, 1, (1, 16)))),
    "qwen2.5-0.5b-shape": ("qwen2.5-0.5b-shape", (Workload("generation", 128, 128, (1,)),
                                                  Workload("generation", 128, 32, (16, 64)),
                                                  Workload("prefill", 512, 1, (1, 16)))),
    "llama3.2-1b-shape": ("llama3.2-1b-shape", (Workload("generation", 128, 64, (1,)),
                                                Workload("generation", 128, 32, (16,)),
                                                Workload("prefill", 512, 1, (1,)))),
    "tiny-llama-shape": ("tiny-llama-shape", (Workload("generation", 32, 8, (1, 4)), Workload("prefill", 64, 1, (1, 4)))),
}
# (our scheme, llama.cpp's types it is compared with); the first is the float baseline
# (int4+head: the LM head quantized too, as llama.cpp's files have it; the engine's default keeps it
# float: loadtests/benchmarks/quant_accuracy.py measured +5% bits per byte for the head at group 128)
PAIRS = (("float32", ("f32",)), ("int8", ("Q8_0",)), ("int4", ("Q4_0", "Q4_K_M")), ("int4+head", ("Q4_0",)),
         ("int8+a8", ("Q8_0",)), ("int4+a8", ("Q4_0",)), ("int4+head+a8", ("Q4_0",)),  # a8: int8 activations
         ("int8+head8+a8", ("Q8_0",)), ("int4+head8+a8", ("Q4_0",)),  # head8: the int8 LM head (the CPU default)
         # compiled: the compiled decode step (enforce_eager=False)
         ("float32+compiled", ("f32",)), ("int8+head8+a8+compiled", ("Q8_0",)), ("int4+head8+a8+compiled", ("Q4_0",)))
# issue 42's targets, as (our scheme, row) -> the least ratio against llama.cpp's pair
TARGETS = {("float32", "decode b1"): 1.0, ("float32", "gen b16"): 1.5, ("float32", "gen b64"): 1.5,
           ("float32", "prefill 16x512"): 1.0, ("int8", "decode b1"): 1.0, ("int8", "gen b16"): 1.5,
           ("int8", "gen b64"): 1.5, ("int4", "decode b1"): 1.0, ("int4", "gen b16"): 1.5, ("int4", "gen b64"): 1.5}


def shape_workloads(shape: str, batch1_only: bool) -> tuple[Workload, ...]:
    """The shape's workloads; `batch1_only`: its batch-1 decode row alone."""
    workloads = SHAPE_RUNS[shape][1]
    if not batch1_only:
        return workloads
    return tuple(Workload(w.kind, w.npp, w.ntg, (1,)) for w in workloads if w.kind == "generation" and 1 in w.npl)


def row_name(work: Workload, npl: int) -> str:
    if work.kind == "prefill":
        return f"prefill {npl}x{work.npp}"
    return "decode b1" if npl == 1 else f"gen b{npl}"


# --- the engine ------------------------------------------------------------------------------------

def run_engine(source: str, scheme: str, workloads: tuple[Workload, ...], args: argparse.Namespace) -> list[dict]:
    llm = LLM(source, device="cpu", dtype="float32",
              engine_config=engine_config(scheme, workloads, args.group))
    engine_batched_bench(llm, 16, 2, 1, seed=99)  # warm-up: the kernels' first calls
    rows = []
    for w in workloads:
        for npl in w.npl:
            rows.append({"work": w, "npl": npl, **engine_batched_bench(llm, w.npp, w.ntg, npl, seed=npl)})
    del llm
    gc.collect()
    return rows


# --- the run ---------------------------------------------------------------------------------------

def run_shape(shape: str, tree: Path, bin_dir: Path, tmp: Path, args: argparse.Namespace) -> list[dict]:
    workloads = shape_workloads(shape, args.batch1_only)
    ckpt = tmp / shape
    checkpoint(SHAPE_RUNS[shape][0], str(ckpt))
    ggufs = convert(tree, bin_dir, ckpt, tmp, [t for _, types in PAIRS for t in types if t in args.types])
    rows = []
    for scheme, types in PAIRS:
        if scheme not in args.schemes:
            continue
        peers = {}
        for t in types:  # back to back: llama.cpp's rows, then the engine's, on the same weights
            if t in ggufs:
                peers[t] = {w: run_llama_cpp(bin_dir, ggufs[t], w, args.threads) for w in workloads}
        ours = run_engine(str(ckpt), scheme, workloads, args)
        for r in ours:
            w, npl = r["work"], r["npl"]
            key = "speed_pp" if w.kind == "prefill" else "speed_tg"
            name = row_name(w, npl)
            for t, by_work in peers.items():
                theirs = by_work[w][npl][key]
                target = TARGETS.get((scheme.partition("+")[0], name)) if t in ("f32", "Q8_0", "Q4_0") else None
                rows.append({"shape": shape, "row": name, "ours": scheme, "llama_cpp": t, "ours_tok_s": r[key],
                             "llama_cpp_tok_s": theirs, "ratio": r[key] / theirs, "target": target,
                             "ours_raw": {k: v for k, v in r.items() if k != "work"},
                             "llama_cpp_raw": by_work[w][npl]})
            print(f"  {shape} {name} {scheme}: {r[key]:.1f} tok/s"
                  + "".join(f", {t} {by_work[w][npl][key]:.1f}" for t, by_work in peers.items()), flush=True)
    base = {(r["row"]): r["ours_tok_s"] for r in rows if r["ours"] == "float32"}
    for r in rows:
        r["ours_vs_float32"] = r["ours_tok_s"] / base[r["row"]] if r["row"] in base else None
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    for g in ggufs.values():
        g.unlink()
    return rows


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = ["shape", "row", "ours", "tok/s", "llama.cpp", "tok/s", "ratio", "target", "ours vs float32"]
    out = []
    for r in rows:
        target = "-" if r["target"] is None else f">= {r['target']:.1f}x " + (
            "reached" if r["ratio"] >= r["target"] else "not reached")
        if r["row"].startswith("prefill") and r["ours"] != "float32":
            target = ">= 1.0x fp32 " + ("reached" if r["ours_vs_float32"] >= 1.0 else "not reached")
        out.append([r["shape"], r["row"], r["ours"], f"{r['ours_tok_s']:.1f}", r["llama_cpp"],
                    f"{r['llama_cpp_tok_s']:.1f}", f"{r['ratio']:.2f}", target,
                    "-" if r["ours_vs_float32"] is None else f"{r['ours_vs_float32']:.2f}"])
    return columns, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt2-small", "qwen2.5-0.5b-shape", "llama3.2-1b-shape"],
                    choices=list(SHAPE_RUNS))
    ap.add_argument("--schemes", nargs="+", default=[s for s, _ in PAIRS], choices=[s for s, _ in PAIRS])
    ap.add_argument("--types", nargs="+", default=["f32", "Q8_0", "Q4_0", "Q4_K_M"],
                    help="llama.cpp's weight types to run (f32 is always converted)")
    ap.add_argument("--group", type=int, default=128, help="the engine's int4 group size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                    / "qkv-serve", help="where llama.cpp's source and build are kept")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    ap.add_argument("--batch1-only", action="store_true", help="only each shape's batch-1 decode row")
    ap.add_argument("--quick", action="store_true", help="the tiny Llama shape, f32 and Q8_0 only")
    add_result_args(ap, "results/bench_llama_cpp.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.schemes, args.types = ["tiny-llama-shape"], ["float32", "int8"], ["f32", "Q8_0"]
    torch.set_num_threads(args.threads)
    tree = llama_cpp_tree(args.cache)
    bin_dir = build_llama_cpp(tree, args.jobs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            rows += run_shape(shape, tree, bin_dir, Path(tmp), args)
    columns, table_rows = table(rows)
    print_table(columns, table_rows)
    if args.out:
        raw = {"threads": args.threads, "llama_cpp_python_sdist": LLAMA_CPP_PYTHON, "cmake_flags": CMAKE_FLAGS,
               "int4_group": args.group, "cpu": cpu_model(),
               "workloads": {s: [vars(w) | {"npl": list(w.npl)} for w in shape_workloads(s, args.batch1_only)]
                             for s in args.shapes},
               "rows": rows}
        write_result(args.out, "bench_llama_cpp", columns, table_rows, raw=raw, note=args.note,
                     title="The engine against llama.cpp, same weights, same threads")


if __name__ == "__main__":
    main()
