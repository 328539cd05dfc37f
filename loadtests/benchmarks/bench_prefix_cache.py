"""Prefix caching on vs off, in one run, on the bare engine (no Ray, no HTTP).

Workloads (token ids drawn from a fixed seed; greedy, ignore_eos):
- shared: N requests arriving at once, each a S-token system prompt shared by all plus its own
  U-token user turn (U uniform in 32..128), M output tokens each;
- chat: C conversations of T turns each, running side by side; turn t+1 is sent when turn t
  has finished and resends the whole history (system prompt, every user turn, every answer).

For each workload and setting: TTFT p50/p99 (arrival to first token, queueing included),
throughput (requests/s and prompt+output tokens/s), and the prefix-cache hit rate (prompt
tokens found cached / prompt tokens looked up). The model is the paper's base Transformer
(d_model 512, 6 layers, random weights from a fixed seed) with 2,048 positions, so that
prefill is what costs.

    .venv/bin/python loadtests/benchmarks/bench_prefix_cache.py [--requests 64] [--system-tokens 1024] \
        [--conversations 8 --turns 6] [--out docs/results/bench_prefix_cache.json] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.config import EngineConfig  # noqa: E402
from model.config import PRESETS  # noqa: E402
from model.engine.builder import build_engine
from model.engine.engine import Engine  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.models.transformer import Transformer  # noqa: E402
from model.sampling.params import SamplingParams  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

VOCAB = 256  # byte ids; the byte tokenizer's EOS (256) is never drawn


@dataclass
class Run:
    """What one workload did on one engine."""

    ttft: list[float] = field(default_factory=list)
    requests: int = 0
    tokens: int = 0  # prompt + output
    seconds: float = 0.0

    def summary(self, engine: Engine) -> dict:
        stats = engine.stats()
        q = sorted(self.ttft)
        return {"requests": self.requests, "seconds": self.seconds,
                "ttft_p50_s": statistics.median(q), "ttft_p99_s": q[min(len(q) - 1, int(0.99 * len(q)))],
                "requests_per_s": self.requests / self.seconds, "tokens_per_s": self.tokens / self.seconds,
                "hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)}


def drive(engine: Engine, first: list[tuple[str, list[int]]], max_tokens: int,
          follow_up=None) -> Run:
    """Run requests to completion; `follow_up(request_id, prompt, output)` may return the next
    (request_id, prompt) to send when one finishes (a conversation's next turn)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    run, prompts, outputs = Run(), {}, {}
    t0 = time.perf_counter()
    for rid, prompt in first:
        engine.add_request(rid, prompt, params)
        prompts[rid], outputs[rid] = prompt, []
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if not out.finished:
                continue
            run.ttft.append(out.times.first_token - out.times.arrival)
            run.requests += 1
            run.tokens += out.num_prompt_tokens + out.num_output_tokens
            nxt = follow_up(out.request_id, prompts[out.request_id], outputs[out.request_id]) if follow_up else None
            if nxt is not None:
                engine.add_request(nxt[0], nxt[1], params)
                prompts[nxt[0]], outputs[nxt[0]] = nxt[1], []
    run.seconds = time.perf_counter() - t0
    return run


def shared_prompt(engine: Engine, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    system = [rng.randrange(VOCAB) for _ in range(args.system_tokens)]
    first = [(f"s{i}", system + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 128))])
             for i in range(args.requests)]
    return drive(engine, first, args.max_tokens).summary(engine)


def chat(engine: Engine, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(VOCAB) for _ in range(args.chat_system_tokens)]
    users = {c: [[rng.randrange(VOCAB) for _ in range(rng.randint(32, 96))] for _ in range(args.turns)]
             for c in range(args.conversations)}

    def follow_up(rid: str, prompt: list[int], output: list[int]) -> tuple[str, list[int]] | None:
        c, t = map(int, rid[1:].split("-"))
        if t + 1 >= args.turns:
            return None
        return f"c{c}-{t + 1}", prompt + output + users[c][t + 1]

    first = [(f"c{c}-0", system + users[c][0]) for c in range(args.conversations)]
    return drive(engine, first, args.chat_max_tokens, follow_up).summary(engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--chat-system-tokens", type=int, default=256)
    ap.add_argument("--chat-max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    add_result_args(ap, "results/bench_prefix_cache.json")
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="qkv-bench-prefix-")
    cfg = PRESETS["transformer-base"].replace(max_position=2048)
    net = Transformer(cfg)
    net.init_weights(cfg.init_seed)
    save_model(net, tmp)
    res: dict = {"model": "transformer-base (random), max_position 2048", "threads": torch.get_num_threads(),
                 "args": vars(args)}
    for name, workload in (("shared", shared_prompt), ("chat", chat)):
        for caching in (False, True):
            config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory_bytes=2 << 30,
                                  enable_prefix_caching=caching)
            engine = build_engine(tmp, config, device="cpu", dtype="float32")
            key = f"{name}_{'on' if caching else 'off'}"
            res[key] = workload(engine, args)
            print(f"{key}: {json.dumps({k: round(v, 4) for k, v in res[key].items()})}", flush=True)
            del engine
    res["load_average_1m_start_end"] = [load_at_start, os.getloadavg()[0]]  # this machine is shared
    columns, rows = table(res)
    print_table(columns, rows)
    print(f"1-minute load average at start/end: {load_at_start:.2f} / {os.getloadavg()[0]:.2f}")
    if args.out:
        write_result(args.out, "bench_prefix_cache", columns, rows, raw=res, note=args.note,
                     title="Prefix caching off and on, bare engine")

def table(r: dict) -> tuple[list[str], list[list[str]]]:
    columns = ["workload", "caching", "TTFT p50", "TTFT p99", "req/s", "tok/s", "hit rate", "TTFT p50 off/on",
               "throughput on/off"]
    rows = []
    for name in ("shared", "chat"):
        off, on = r[f"{name}_off"], r[f"{name}_on"]
        for label, x in (("off", off), ("on", on)):
            ratio = ["", ""] if label == "off" else [f"{off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x",
                                                     f"{on['tokens_per_s'] / off['tokens_per_s']:.2f}x"]
            rows.append([name, label, f"{x['ttft_p50_s']:.2f} s", f"{x['ttft_p99_s']:.2f} s",
                         f"{x['requests_per_s']:.2f}", f"{x['tokens_per_s']:.0f}", f"{100 * x['hit_rate']:.1f}%",
                         *ratio])
    return columns, rows

if __name__ == "__main__":
    main()
