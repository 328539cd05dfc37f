"""Offline engine throughput against HF transformers and against the machine's own bounds.

Everything in one run, on the same random weights: GPT-2-small-shaped (124M parameters,
the default) or, with `--model qwen2.5-0.5b-shape`, Qwen2.5-0.5B-shaped (494M, GQA 14:2,
tied head, saved in bf16 by loadtests/lib/checkpoints.py):
- workload: N requests, prompts 32-256 tokens, max_tokens uniform in 16-256, greedy, ignore_eos;
- baseline: HF `generate()` in static batches of 16 with left padding, each batch running
  to its longest request (how one serves without an engine). It runs first, before the engine
  sets its process's malloc to keep freed memory (model/engine/host_memory.py), so HF runs as it
  does on its own;
- the engine (continuous batching over the paged KV cache);
- the engine with the KV cache disabled (full recompute every token) on a short run;
- batch-1 decode tokens/s;
- roofline: measured matmul GFLOP/s and memory GB/s, and the fraction the engine reaches;
- the share of a batch-64 decode step (context ~270) spent in attention over the paged cache
  (torch.profiler, loadtests/lib/step_profile.py), through the fused kernel and through the gather path.

    .venv/bin/python loadtests/benchmarks/bench_engine.py [--requests 64] [--out docs/results/bench_engine.json]
    .venv/bin/python loadtests/benchmarks/bench_engine.py --model qwen2.5-0.5b-shape --requests 16 --no-extras
    .venv/bin/python loadtests/benchmarks/bench_engine.py --model qwen3-moe-1b-shape --requests 16 --no-extras
    .venv/bin/python loadtests/benchmarks/bench_engine.py --model gemma3-1b-shape --requests 8 --hf-batch 8 --max-new-tokens 48 --no-extras

A mixture-of-experts shape (`qwen3-moe-1b-shape`: 1.18B parameters, 64 experts of 256, top-8,
written by transformers in bf16, loadtests/lib/checkpoints.py) adds a torch.profiler breakdown
of a batch-16 decode step of the MoE layer (loadtests/lib/moe_profile.py); the bandwidth and
compute fractions count the weights a token uses (its top-k experts), not all of them.

`--no-extras` runs only the workload (engine and HF) and batch-1 decode.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import MOE_SHAPES, PRESET, SHAPES, checkpoint  # noqa: E402
from loadtests.lib.engine_steps import decode_rate, set_backend  # noqa: E402
from loadtests.lib.moe_profile import print_moe_profile, profile_moe_decode  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.rooflines import copy_bandwidth_gbs, matmul_gflops, sync  # noqa: E402
from loadtests.lib.step_profile import profile_decode  # noqa: E402
from loadtests.lib.workloads import workload  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.loading.checkpoint import load_config  # noqa: E402
from model.loading.loading import resolve_device  # noqa: E402


def run_hf(path: str, prompts: list[list[int]], max_tokens: list[int], batch: int,
           device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        group, limits = prompts[i:i + batch], max_tokens[i:i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits), min_new_tokens=max(limits),
                           do_sample=False, pad_token_id=0)
        useful += sum(limits)
    sync(device)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "output_tokens": useful, "tokens_per_s": useful / secs}


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(llm.engine.device)
    secs = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(max_tokens), "the engine did not produce every requested token"
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs}


def weight_bytes_read(net: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes a decode step must read: every weight but the tables whose rows are gathered
    (learned positions; the token embedding when the LM head is a separate matrix)."""
    gathered = {"wpe.weight"} | ({"embed_tokens.weight"} if getattr(net, "lm_head", None) is not None else set())
    n = sum(p.numel() for name, p in net.named_parameters() if name not in gathered)
    return (n - inactive_expert_params(net)) * torch.empty((), dtype=dtype).element_size()


def inactive_expert_params(net: torch.nn.Module) -> int:
    """Expert weights one token does not use: all but its top-k experts of each MoE layer."""
    moe = net.cfg.moe
    if moe is None:
        return 0
    experts = sum(p.numel() for name, p in net.named_parameters() if ".experts." in name)
    return experts * (moe.num_experts - moe.top_k) // moe.num_experts


def extras(res: dict, llm: LLM, tmp: str, args: argparse.Namespace, prompts: list[list[int]]) -> None:
    """The short no-KV-cache comparison and the batch-64 decode rate."""
    short_p, short_m = prompts[:8], [16] * 8
    nocache = LLM(tmp, device=args.device, dtype=args.dtype,
                  engine_config=EngineConfig(enable_kv_cache=False, max_num_batched_tokens=4096, kv_cache_memory_bytes=1 << 30))
    res["engine_short"] = run_engine(llm, short_p, short_m)
    res["engine_no_kv_cache_short"] = run_engine(nocache, short_p, short_m)
    del nocache
    res["decode_b64_tok_s"] = decode_rate(llm, 64, llm.engine.model_config.vocab_size, steps=16)
    res["compute_fraction_b64"] = res["decode_b64_tok_s"] * 2 * res["active_params"] / 1e9 / res["matmul_gflops"]
    for backend in ("fused", "gather"):
        if set_backend(llm.engine, backend):
            res[f"attention_b64_{backend}"] = profile_decode(llm.engine, 64, 270)
    set_backend(llm.engine, "fused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=PRESET, choices=[PRESET, *SHAPES, *MOE_SHAPES],
                    help="weights to run: the GPT-2 preset or a random checkpoint of a real model's shape")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=256,
                    help="the most tokens a request asks for (the 1B shapes: 32-64 keeps HF generate's side bounded)")
    ap.add_argument("--no-extras", action="store_true", help="skip the no-KV-cache run and batch-64 decode")
    add_result_args(ap, "results/bench_engine.json")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    tmp = tempfile.mkdtemp(prefix="qkv-bench-")
    checkpoint(args.model, tmp)
    prompts, max_tokens = workload(args.requests, args.seed, load_config(tmp).vocab_size, args.max_new_tokens)
    # HF first, in a process whose malloc is still glibc's default, as HF runs on its own: a CPU
    # engine makes its process keep freed memory (model/engine/host_memory.py), which would spare
    # HF's steps their page faults too.
    hf = run_hf(tmp, prompts, max_tokens, args.hf_batch, device, dtype)
    llm = LLM(tmp, device=args.device, dtype=args.dtype,
              engine_config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory_bytes=3 << 30,
                                         max_model_len=2048))
    cfg = llm.engine.model_config
    net = llm.engine.runner.model
    n_params = sum(p.numel() for p in net.parameters())
    res: dict = {"model": args.model, "device": str(device), "dtype": args.dtype, "params": n_params,
                 "active_params": n_params - inactive_expert_params(net),
                 "requests": args.requests, "max_new_tokens": args.max_new_tokens, "hf_batch": args.hf_batch,
                 "threads": torch.get_num_threads()}
    res["matmul_gflops"] = matmul_gflops(device, dtype)
    res["memory_gbs"] = copy_bandwidth_gbs(device)
    print(f"model {args.model}: {n_params / 1e6:.1f}M params, {device}, {args.dtype}, {res['threads']} threads")
    res["engine"] = run_engine(llm, prompts, max_tokens)
    print(f"engine: {res['engine']['tokens_per_s']:.1f} tok/s")
    res["hf"] = hf
    print(f"hf: {res['hf']['tokens_per_s']:.1f} tok/s")
    if not args.no_extras:
        extras(res, llm, tmp, args, prompts)
    if cfg.moe is not None:
        res["moe_decode_profile"] = profile_moe_decode(llm.engine, 16, 128)
    res["decode_b1_tok_s"] = decode_rate(llm, 1, cfg.vocab_size)
    res["bandwidth_fraction_b1"] = res["decode_b1_tok_s"] * weight_bytes_read(net, dtype) / 1e9 / res["memory_gbs"]
    res["load_average_1m_start_end"] = [load_at_start, os.getloadavg()[0]]  # this machine is shared
    columns, rows = table(res)
    print_table(columns, rows)
    if "moe_decode_profile" in res:
        print_moe_profile(res["moe_decode_profile"])
    print(f"1-minute load average at start/end: {load_at_start:.2f} / {os.getloadavg()[0]:.2f} (2 cores)")
    if args.out:
        write_result(args.out, "bench_engine", columns, rows, raw=res, note=args.note, device=str(device),
                     title=f"Engine against HF generate: {args.model}, {args.requests} requests, {args.dtype}")

def table(r: dict) -> tuple[list[str], list[list[str]]]:
    e, h = r["engine"], r["hf"]
    rows = [
        (f"HF generate, static batches of {r['hf_batch']}", f"{h['tokens_per_s']:.1f} tok/s", "1.00x"),
        ("qkv engine, continuous batching", f"{e['tokens_per_s']:.1f} tok/s", f"{e['tokens_per_s'] / h['tokens_per_s']:.2f}x"),
    ]
    if "engine_short" in r:
        rows += [
            ("engine, short run (8 req x 16 tok)", f"{r['engine_short']['tokens_per_s']:.1f} tok/s", "1.00x"),
            ("engine, KV cache off, same short run", f"{r['engine_no_kv_cache_short']['tokens_per_s']:.1f} tok/s",
             f"{r['engine_no_kv_cache_short']['tokens_per_s'] / r['engine_short']['tokens_per_s']:.2f}x"),
        ]
    rows.append(("decode, batch 1", f"{r['decode_b1_tok_s']:.1f} tok/s",
                 f"{100 * r['bandwidth_fraction_b1']:.0f}% of bandwidth bound"))
    if "decode_b64_tok_s" in r:
        rows.append(("decode, batch 64", f"{r['decode_b64_tok_s']:.1f} tok/s",
                     f"{100 * r['compute_fraction_b64']:.0f}% of matmul peak"))
    for backend in ("fused", "gather"):
        if f"attention_b64_{backend}" in r:
            a = r[f"attention_b64_{backend}"]
            rows.append((f"batch-64 decode step, {backend} attention", f"{a['step_ms']:.1f} ms",
                         f"attention {100 * a['attention_share']:.0f}% of the step"))
    rows += [("measured matmul peak", f"{r['matmul_gflops']:.1f} GFLOP/s", ""),
             ("measured copy bandwidth", f"{r['memory_gbs']:.1f} GB/s", "")]
    return ["what", "figure", "ratio"], [list(row) for row in rows]


if __name__ == "__main__":
    main()
