"""Where a CPU decode step goes, for the rows of the llama.cpp comparison that miss their target:
the engine's step at the CPU defaults (float32; int8 and int4 with int8 activations and the int8
LM head) on the comparison's shapes, at 1 and 16 sequences, split into

- products: the linear layers and the LM head (the project's dense and quantized kernels, or
  torch's mm/addmm where they hand over), with the rate at which they read the weights;
- attention: the paged-attention kernel;
- other ops: every other torch op (norms, activations, rotary, sampling, copies);
- outside ops: the step's wall time (measured without the profiler) less the ops' self time
  (measured with it): Python, the scheduler and the op dispatch between kernels;
- ops per step: the profiler's events per step (torch ops; under the compiled step, scheme
  `...+compiled`, Inductor's generated kernels and the compiled region count as ops too).

The products' floor is their weight bytes at the machine's read bandwidth (one read per step),
measured in the same run by a read-only probe (`read_bandwidth_gbs`: the median of several passes,
taken before and after the profiles; the higher of the two is the bound, what the machine showed
it can do in this run); "of read bound" is that floor over the whole step's time, the share of the
bound the step reaches.

    .venv/bin/python loadtests/profilers/profile_decode_split.py --out docs/results/profile_decode_split.json
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import PRESET as GPT2_PRESET, checkpoint  # noqa: E402
from loadtests.lib.llama_cpp import Workload, engine_config  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.rooflines import read_bandwidth_gbs  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.layers.linear.quantized import QuantizedLinear  # noqa: E402

SHAPES = {"gpt2-small": GPT2_PRESET, "qwen2.5-0.5b-shape": "qwen2.5-0.5b-shape"}
SCHEMES = ("float32", "int8+head8+a8", "int4+head8+a8")
# Also accepted: the same with the compiled decode step (enforce_eager=False).
COMPILED = tuple(f"{s}+compiled" for s in SCHEMES)
PRODUCT_OPS = ("qkv_dense::", "qkv_quant::", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_OPS = ("qkv_paged::",)


def product_bytes(net: torch.nn.Module) -> int:
    """Bytes the products read once per step: every linear layer's weights (codes, scales and
    offsets for a quantized one) and the LM head, tied or not."""
    total = 0
    for module in net.modules():
        if isinstance(module, QuantizedLinear):
            total += sum(b.numel() * b.element_size() for name, b in module.named_buffers(recurse=False)
                         if name != "perm" and b is not None)
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    if getattr(net, "lm_head", None) is None and not hasattr(net, "quantized_head"):  # tied: the head reads the token embedding's table
        emb = getattr(net, "embed_tokens", None) or getattr(net, "wte", None)
        if isinstance(emb, torch.nn.Embedding):
            total += emb.weight.numel() * emb.weight.element_size()
    return total


def kind(op: str) -> str:
    if op.startswith(PRODUCT_OPS):
        return "products"
    if op.startswith(ATTENTION_OPS):
        return "attention"
    return "other ops"


def fill(llm: LLM, batch: int, context: int, steps: int) -> None:
    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", [rng.randrange(vocab) for _ in range(context)],
                           SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    while any(r.seq.num_computed_tokens < context for r in engine._requests.values()):
        engine.step()
    engine.step()  # warm-up: one decode step


def split(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Wall time of `steps` decode steps unprofiled, then the ops' self time of as many profiled."""
    engine = llm.engine
    fill(llm, batch, context, 2 * steps + 4)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    parts = {"products": 0.0, "attention": 0.0, "other ops": 0.0}
    top: list[tuple[float, str]] = []
    calls = 0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / steps / 1e3
        parts[kind(e.key)] += ms
        top.append((ms, e.key))
        calls += e.count
    top.sort(reverse=True)
    return {"step_ms": wall, **parts, "outside ops": wall - sum(parts.values()), "ops_per_step": calls / steps,
            "top_ops": [{"op": k, "self_ms": ms} for ms, k in top[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES + COMPILED))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--context", type=int, default=192, help="tokens each sequence holds while profiled")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--group", type=int, default=128)
    add_result_args(ap, default_out=None)
    args = ap.parse_args()
    probes = [read_bandwidth_gbs(torch.device("cpu"))]
    workloads = (Workload("generation", args.context, 2 * args.steps + 4, tuple(args.batches)),)
    rows, raw = [], []
    for shape in args.shapes:
        with tempfile.TemporaryDirectory(prefix="qkv-split-") as tmp:
            checkpoint(SHAPES[shape], tmp)
            for scheme in args.schemes:
                llm = LLM(tmp, device="cpu", dtype="float32",
                          engine_config=engine_config(scheme, workloads, args.group))
                for batch in args.batches:
                    r = split(llm, batch, args.context, args.steps)
                    raw.append({"shape": shape, "scheme": scheme, "batch": batch,
                                "weight_bytes": product_bytes(llm.engine.runner.model), **r})
                    print(shape, scheme, batch, f"{r['step_ms']:.1f} ms", flush=True)
                del llm
                gc.collect()
    probes.append(read_bandwidth_gbs(torch.device("cpu")))
    bandwidth = max(probes)
    for r in raw:
        share = {k: r[k] / r["step_ms"] for k in ("products", "attention", "other ops", "outside ops")}
        floor = r["weight_bytes"] / (bandwidth * 1e9) * 1e3
        rows.append([r["shape"], r["scheme"], r["batch"], r["step_ms"], r["batch"] * 1e3 / r["step_ms"],
                     f"{r['products']:.1f} ({share['products']:.0%})",
                     f"{r['attention']:.1f} ({share['attention']:.0%})",
                     f"{r['other ops']:.1f} ({share['other ops']:.0%})",
                     f"{r['outside ops']:.1f} ({share['outside ops']:.0%})", round(r["ops_per_step"]),
                     r["weight_bytes"] / 1e6, floor, r["weight_bytes"] / r["products"] / 1e6 if r["products"] else None,
                     f"{floor / r['step_ms']:.0%}"])
    columns = ["shape", "scheme", "sequences", "step ms", "tok/s", "products ms", "attention ms", "other ops ms",
               "outside ops ms", "ops per step", "weights MB", "products floor ms", "products read GB/s",
               "of read bound"]
    print(f"read bandwidth: {probes[0]:.1f} GB/s before, {probes[1]:.1f} GB/s after (the bound: the higher)")
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "profile_decode_split", columns, rows,
                     raw={"read_bandwidth_gb_s": bandwidth, "read_bandwidth_probes_gb_s": probes, "runs": raw},
                     note=args.note)


if __name__ == "__main__":
    main()
