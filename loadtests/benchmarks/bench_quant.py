"""What weight-only quantization gains in speed and memory, against float32, in one run.

For each shape (GPT-2-small, the preset with random weights; Qwen2.5-0.5B, a random checkpoint
in bf16 written by loadtests/lib/checkpoints.py) and each scheme (`none`, `int8`, `int4` at
`--group`, each with the LM head in float32 (`quantize_lm_head: false`), in int8 (`int8`, what
`auto` picks on the CPU) and as the layers (`true`); a quantized head of the tied Qwen2.5 shape
also makes the embedding table the quantized head's):

- batch-1 and batch-16 decode tokens/s (steady state, 128-token prompts; loadtests/lib/engine_steps.py's decode_rate);
- batch-1 prefill tokens/s (one `--prefill`-token prompt, time to its first token);
- the weights' resident bytes (parameters and buffers) and their ratio to float32;
- for checkpoint shapes, the peak RSS of a fresh process that only loads the model (the
  load quantizes tensor by tensor, so this stays near the quantized size, not float32's).

    .venv/bin/python loadtests/benchmarks/bench_quant.py [--shapes gpt2-small qwen2.5-0.5b-shape] [--group 128]
    .venv/bin/python loadtests/benchmarks/bench_quant.py --quick   # a tiny shape, a few steps: checks it runs
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import write_random_checkpoint  # noqa: E402
from loadtests.lib.engine_steps import decode_rate  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.loading.quant.quantize import resident_bytes  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

PRESETS = {"gpt2-small": "gpt2-small-random"}  # shape name -> preset (random weights, built in memory)
QUICK_SHAPE = "tiny-qwen-shape"  # --quick: tied like Qwen2.5, with widths that groups of 128 divide

HEAD = {False: "float32", "int8": "int8", True: "as the layers"}  # quantize_lm_head -> the table's word

_PEAK = """
import sys, torch
sys.path.insert(0, {root!r})
from model.loading.loading import load_weights
from model.loading.quant.quantize import head_scheme, on_the_fly_scheme
scheme = on_the_fly_scheme({method!r}, {group})
load_weights({path!r}, torch.float32, torch.device("cpu"), quantize=scheme,
             quantize_lm_head=head_scheme({head!r}, scheme, torch.device("cpu")) or False)
# VmHWM, not ru_maxrss: Linux carries the parent's high-water mark across fork + exec into
# ru_maxrss, so a child of this (model-holding) benchmark would report the parent's size
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


def prefill_rate(llm: LLM, length: int, vocab: int) -> float:
    rng = random.Random(length)
    prompt = [rng.randrange(vocab) for _ in range(length)]
    llm.generate([prompt[:16]], SamplingParams(max_tokens=1, temperature=0.0))  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return length / (time.perf_counter() - t0)


def load_peak_rss(path: str, method: str, group: int, head: bool | str) -> int:
    code = _PEAK.format(root=str(Path(__file__).resolve().parents[2]), method=method, group=group, path=path,
                        head=head)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def run_shape(shape: str, source: str, args: argparse.Namespace) -> list[dict]:
    rows = []
    schemes = [("none", False), *((m, h) for h in (False, "int8", True) for m in ("int8", "int4"))]
    for method, head in schemes:
        if method == "none" and head:
            continue
        ec = EngineConfig(max_num_seqs=16, num_kv_blocks=args.kv_blocks, quantization=method,
                          quantization_group_size=args.group, quantize_lm_head=head)
        t0 = time.perf_counter()
        llm = LLM(source, device="cpu", dtype="float32", engine_config=ec)
        load_s = time.perf_counter() - t0
        vocab = llm.engine.model_config.vocab_size
        net = llm.engine.runner.model
        row = {"shape": shape, "scheme": method if method != "int4" else f"int4-g{args.group}",
               "quantize_lm_head": head, "load_s": load_s, "weight_bytes": resident_bytes(net),
               "decode_b1_tok_s": decode_rate(llm, 1, vocab, steps=args.steps),
               "decode_b16_tok_s": decode_rate(llm, 16, vocab, steps=args.steps),
               "prefill_b1_tok_s": prefill_rate(llm, args.prefill, vocab)}
        if shape not in PRESETS and not args.no_peak:
            row["load_peak_rss_bytes"] = load_peak_rss(source, method, args.group, head)
        rows.append(row)
        print(f"  {shape} {row['scheme']} head {HEAD[head]}: {row['decode_b1_tok_s']:.1f} tok/s b1", flush=True)
        del llm, net
    base = rows[0]
    for r in rows:
        for key in ("weight_bytes", "decode_b1_tok_s", "decode_b16_tok_s", "prefill_b1_tok_s"):
            r[f"{key}_vs_none"] = r[key] / base[key]
    return rows


def table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = ["shape", "scheme", "LM head", "decode b1 tok/s", "x", "decode b16 tok/s", "x", "prefill b1 tok/s", "x",
               "weights MiB", "x", "load peak MiB"]
    return columns, [[r["shape"], r["scheme"], HEAD[r["quantize_lm_head"]],
                      f"{r['decode_b1_tok_s']:.1f}", f"{r['decode_b1_tok_s_vs_none']:.2f}",
                      f"{r['decode_b16_tok_s']:.1f}", f"{r['decode_b16_tok_s_vs_none']:.2f}",
                      f"{r['prefill_b1_tok_s']:.1f}", f"{r['prefill_b1_tok_s_vs_none']:.2f}",
                      f"{r['weight_bytes'] / 2**20:.1f}", f"{r['weight_bytes_vs_none']:.2f}",
                      f"{r['load_peak_rss_bytes'] / 2**20:.0f}" if "load_peak_rss_bytes" in r else "-"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt2-small", "qwen2.5-0.5b-shape"])
    ap.add_argument("--group", type=int, default=128, help="int4 group size")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill run")
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--no-peak", action="store_true", help="skip the load-peak-RSS subprocesses")
    ap.add_argument("--quick", action="store_true", help="a tiny Qwen-like shape, 4 steps, 64-token prefill")
    add_result_args(ap, "results/bench_quant.json")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.steps, args.prefill, args.kv_blocks = [QUICK_SHAPE], 4, 64, 256
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            if shape in PRESETS:
                source = PRESETS[shape]
            else:
                source = str(Path(tmp) / shape)
                write_random_checkpoint(source, shape, torch.bfloat16)
            rows += run_shape(shape, source, args)
    columns, table_rows = table(rows)
    print_table(columns, table_rows)
    if args.out:
        raw = {"torch_threads": torch.get_num_threads(), "group_size": args.group, "steps": args.steps,
               "prefill_tokens": args.prefill, "rows": rows}
        write_result(args.out, "bench_quant", columns, table_rows, raw=raw, note=args.note,
                     title="Weight-only quantization against float32")

if __name__ == "__main__":
    main()
