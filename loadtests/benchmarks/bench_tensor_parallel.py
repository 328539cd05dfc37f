"""Tensor parallelism's cost on this machine: the same model and batch at TP=1 and TP=2, in one run.

For each: generated tokens per second (greedy, ignore_eos, every prompt admitted at once) and, at
TP=2, per engine step: the time the workers spent inside all-reduce/gather (rank 0's, measured in
the worker with perf_counter around each collective), the slowest worker's step, and the Ray
message round trip beyond it (driver wall time of the step's `ray.get` minus that step).
TP=1 runs on as many torch threads as the TP=2 workers have together.

    .venv/bin/python loadtests/benchmarks/bench_tensor_parallel.py [--model transformer-base] [--batch 16]
        [--prompt-len 64] [--max-tokens 32] [--worker-cpus 1] [--out docs/results/bench_tensor_parallel.json]
    .venv/bin/python loadtests/benchmarks/bench_tensor_parallel.py --quick     # a tiny preset, checks it runs
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402


def run(model: str, tp: int, prompts: list[list[int]], max_tokens: int, worker_cpus: float) -> dict:
    # TP=1 gets the threads of both TP=2 workers together; each TP=2 worker sets its own.
    threads = max(1, int(2 * worker_cpus)) if tp == 1 else max(1, int(worker_cpus))
    before = torch.get_num_threads()
    torch.set_num_threads(threads if tp == 1 else before)
    ec = EngineConfig(max_num_seqs=len(prompts), tp_worker_num_cpus=worker_cpus, enable_prefix_caching=False)
    llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=tp, engine_config=ec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        stats0 = _stats(llm)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        stats1 = _stats(llm)
    finally:
        llm.shutdown()
        torch.set_num_threads(before)
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"tp": tp, "threads_per_rank": threads, "generated_tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds, "token_ids": [o.token_ids for o in outs]}
    if stats1 is not None:
        steps = stats1["steps"] - stats0["steps"]
        for key in ("comm_seconds", "worker_seconds", "round_trip_seconds"):
            row[key.replace("seconds", "ms_per_step")] = 1e3 * (stats1[key] - stats0[key]) / max(1, steps)
        row["collectives_per_step"] = (stats1["collectives"] - stats0["collectives"]) / max(1, steps)
        row["steps"] = steps
    return row


def _stats(llm: LLM) -> dict | None:
    stats = getattr(llm.engine.runner, "stats", None)
    return None if stats is None else dict(vars(stats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="transformer-base")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--worker-cpus", type=float, default=1.0, help="CPUs (and torch threads) per TP=2 worker")
    add_result_args(ap, None)
    ap.add_argument("--quick", action="store_true", help="tiny preset, 4 prompts, 8 tokens: checks the script runs")
    args = ap.parse_args()
    if args.quick:
        args.model, args.batch, args.prompt_len, args.max_tokens = "transformer-draft-small", 4, 16, 8
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="warning")
    try:
        rows = [run(args.model, tp, prompts, args.max_tokens, args.worker_cpus) for tp in (1, 2)]
    finally:
        ray.shutdown()
    one, two = rows
    print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} new tokens, fp32 CPU")
    columns = ["TP", "tok/s", "comm ms/step", "worker ms/step", "ray rt ms/step", "coll/step"]
    table = [[str(r["tp"]), f"{r['tokens_per_s']:.1f}", f"{r.get('comm_ms_per_step', 0):.2f}",
              f"{r.get('worker_ms_per_step', 0):.2f}", f"{r.get('round_trip_ms_per_step', 0):.2f}",
              f"{r.get('collectives_per_step', 0):.1f}"] for r in rows]
    print_table(columns, table)
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    same = one["token_ids"] == two["token_ids"]
    print(f"TP=2 / TP=1 throughput: {ratio:.2f}x; greedy tokens identical: {same}")
    if args.out:
        for r in rows:
            r.pop("token_ids")
        raw = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
               "ratio": ratio, "identical": same, "runs": rows}
        write_result(args.out, "bench_tensor_parallel", columns, table, raw=raw, note=args.note,
                     title=f"Tensor parallelism: {args.model}, batch {args.batch}, prompt {args.prompt_len}, "
                           f"{args.max_tokens} new tokens, TP=2 / TP=1 {ratio:.2f}x")

if __name__ == "__main__":
    main()
