"""Prefill speed at batch 1 in float32 against bfloat16 weights, in one run, on the CPU.

The engine on the GPT-2-small shape (random weights) prefills one `--prompt-len`-token prompt
at a time (max_tokens 1), best of `--repeats`, each dtype in turn and the whole alternation
`--rounds` times; it also reports the matmul rate of each dtype (a 256 x 768 x 3072 product,
one of the prefill's own shapes). bfloat16 matmuls run on AVX512-BF16 where the CPU has it.

    .venv/bin/python loadtests/benchmarks/bench_prefill_dtype.py [--prompt-len 256] [--rounds 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

PRESET = "gpt2-small-random"
DTYPES = ("float32", "bfloat16")


def matmul_gflops(dtype: torch.dtype, repeats: int = 20) -> float:
    a, w, b = torch.randn(256, 768, dtype=dtype), torch.randn(3072, 768, dtype=dtype), torch.randn(3072, dtype=dtype)
    for _ in range(3):
        torch.addmm(b, a, w.t())
    start = time.perf_counter()
    for _ in range(repeats):
        torch.addmm(b, a, w.t())
    return 2 * 256 * 768 * 3072 * repeats / (time.perf_counter() - start) / 1e9


def prefill_tok_s(llm: LLM, prompt_len: int, repeats: int, seed: int) -> float:
    rng = random.Random(seed)
    best = float("inf")
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([[rng.randrange(256) for _ in range(prompt_len)]], one)  # warm-up
    for _ in range(repeats):
        prompt = [rng.randrange(256) for _ in range(prompt_len)]  # fresh ids: no prefix-cache hit
        start = time.perf_counter()
        llm.generate([prompt], one)
        best = min(best, time.perf_counter() - start)
    return prompt_len / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_result_args(ap, None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="qkv-prefill-")
    save_model(build_preset(PRESET), tmp)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=max(2048, args.prompt_len), kv_cache_memory_bytes=1 << 30)
    llms = {d: LLM(tmp, dtype=d, engine_config=config) for d in DTYPES}
    best: dict[str, float] = {d: 0.0 for d in DTYPES}
    flops: dict[str, float] = {d: 0.0 for d in DTYPES}
    for k in range(args.rounds):
        for d in DTYPES:
            flops[d] = max(flops[d], matmul_gflops(getattr(torch, d)))
            best[d] = max(best[d], prefill_tok_s(llms[d], args.prompt_len, args.repeats, seed=k))
    title = (f"Prefill, {PRESET}, batch 1, {args.prompt_len}-token prompt, {args.threads} torch threads, best of "
             f"{args.rounds} x {args.repeats}")
    print(title)
    columns = ["weights", "prefill tok/s", "vs float32", "matmul GFLOP/s (256 x 768 x 3072)"]
    rows = [[d, f"{best[d]:.0f}", f"{best[d] / best['float32']:.2f}x", f"{flops[d]:.0f}"] for d in DTYPES]
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_prefill_dtype", columns, rows, raw={"prefill_tok_s": best, "gflops": flops},
                     note=args.note, title=title)

if __name__ == "__main__":
    main()
