"""The prefix cache's offload tier on vs off, in one run, on the bare engine (no Ray, no HTTP).

- shared prefixes: P system prompts of L tokens whose blocks need 4x the pool; one pass over them
  (the warm-up: it fills the tier), then R requests drawn among them, one at a time, each the
  prompt plus 8 tokens of its own and 1 output token: TTFT is the request's whole time. Without
  the tier a prompt whose blocks left the pool is prefilled again; with it, they are read back.
- no reuse: N prompts of U tokens, all different, M output tokens each, all submitted at once into
  a pool that evicts all the time: what writing every evicted block to the tier costs in
  throughput (prompt + output tokens per second).

Settings: `pool` (prefix caching, no tier), `host` (the tier in host memory), `disk` (a file under
a temporary directory). Each round runs every setting; the ratios are medians over rounds (the
no-reuse part's three engines take turns in an order that rotates each round).

    .venv/bin/python loadtests/benchmarks/bench_kv_offload.py [--rounds 3] [--prompts 16] \
        [--prompt-tokens 1000] [--requests 24] [--out docs/results/bench_kv_offload.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.engine.kv.block_manager import blocks_for  # noqa: E402

SETTINGS = ("pool", "host", "disk")


def engine(model: str, setting: str, num_blocks: int, tier_bytes: int, directory: str, max_seqs: int) -> LLM:
    return LLM(model, device="cpu", dtype="float32", engine_config=EngineConfig(
        num_kv_blocks=num_blocks, max_num_seqs=max_seqs,
        kv_offload_bytes=0 if setting == "pool" else tier_bytes,
        kv_offload_dir=directory if setting == "disk" else None))


def block_bytes(model: str) -> int:
    """Bytes of one KV block of `model` (every layer's K and V), from a small engine's pool."""
    cache = engine(model, "pool", 4, 0, "", 1).engine.runner.cache
    return sum(t[0].numel() * t.element_size() for t in cache.keys + cache.values)


def shared_prefixes(llm: LLM, args: argparse.Namespace, seed: int) -> dict:
    rng, vocab = random.Random(seed), llm.engine.model_config.vocab_size - 1  # below the last id (EOS in GPT-2)
    systems = [[rng.randrange(1, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for system in systems:
        llm.generate([system + [rng.randrange(1, vocab) for _ in range(8)]], one)
    warm_s = time.perf_counter() - t0
    ttft = []
    for _ in range(args.requests):
        prompt = rng.choice(systems) + [rng.randrange(1, vocab) for _ in range(8)]
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        ttft.append(time.perf_counter() - t0)
    stats = llm.engine.stats()
    return {"warm_s": warm_s, "ttft_s": ttft, "ttft_p50_s": statistics.median(ttft),
            "ttft_mean_s": statistics.fmean(ttft), "tier_loaded_blocks": stats.kv_offload_loaded_blocks,
            "prefix_hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)}


def no_reuse(llm: LLM, args: argparse.Namespace, seed: int) -> dict:
    rng, vocab = random.Random(seed), llm.engine.model_config.vocab_size - 1
    prompts = [[rng.randrange(1, vocab) for _ in range(args.unique_tokens)] for _ in range(args.unique_prompts)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) for o in outs)
    if llm.engine.kv_offload is not None:
        llm.engine.kv_offload.flush()
    stats = llm.engine.stats()
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "saved_blocks": stats.kv_offload_saved_blocks,
            "skipped_blocks": stats.kv_offload_skipped_blocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-small-random")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the shared-prefix part")
    ap.add_argument("--reuse-rounds", type=int, default=6, help="rounds of the no-reuse part (a noisier figure)")
    ap.add_argument("--prompts", type=int, default=16, help="distinct system prompts")
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="GPT-2 holds 1,024 positions")
    ap.add_argument("--requests", type=int, default=24, help="requests drawn among the system prompts")
    ap.add_argument("--unique-prompts", type=int, default=16)
    ap.add_argument("--unique-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: to check it runs")
    add_result_args(ap, "results/bench_kv_offload.json")
    args = ap.parse_args()
    if args.quick:
        args.model, args.rounds, args.prompts, args.prompt_tokens, args.requests = "transformer-base", 1, 8, 128, 8
        args.reuse_rounds = 2
        args.unique_prompts, args.unique_tokens, args.output_tokens = 8, 64, 4
    # the pool holds a quarter of the system prompts (4x the pool in all); the tier holds them all
    per_prompt = blocks_for(args.prompt_tokens + 9, 16)
    pool_blocks = max(1, args.prompts // 4) * per_prompt
    tier_bytes = 2 * args.prompts * per_prompt * block_bytes(args.model)
    rounds: list[dict] = [{} for _ in range(args.rounds)]
    unique_rounds: list[dict] = [{} for _ in range(args.reuse_rounds)]
    with tempfile.TemporaryDirectory(prefix="qkv-kv-offload-") as directory:
        for r, result in enumerate(rounds):  # a fresh engine per setting: the warm-up sets its state
            for setting in SETTINGS:
                llm = engine(args.model, setting, pool_blocks, tier_bytes, directory, 1)
                result[setting] = {"shared": shared_prefixes(llm, args, seed=r)}
                llm.shutdown()
                print(f"round {r} {setting}: TTFT p50 {result[setting]['shared']['ttft_p50_s'] * 1e3:.0f} ms "
                      f"(tier blocks loaded {result[setting]['shared']['tier_loaded_blocks']})", flush=True)
        # No reuse: the three engines live side by side and take turns (the order rotates each
        # round), so a tier that fills up and evicts its own blocks is measured too.
        reuse_pool = args.max_num_seqs * blocks_for(args.unique_tokens + args.output_tokens, 16)
        engines = {setting: engine(args.model, setting, reuse_pool, tier_bytes, directory, args.max_num_seqs)
                   for setting in SETTINGS}
        for r, result in enumerate(unique_rounds):
            for setting in SETTINGS[r % 3:] + SETTINGS[:r % 3]:
                result[setting] = no_reuse(engines[setting], args, seed=100 + r)
                print(f"round {r} {setting}: no reuse {result[setting]['tokens_per_s']:.0f} tok/s", flush=True)
        for llm in engines.values():
            llm.shutdown()

    def ratios(setting: str, fn) -> list[float]:
        return [fn(r["pool"]) / fn(r[setting]) for r in rounds]

    columns = ["setting", "TTFT p50 ms", "TTFT mean ms", "TTFT p50 speedup over pool", "each round's speedup",
               "tier blocks read (last round)", "no-reuse tok/s", "no-reuse tok/s x pool", "each round's x"]
    rows = []
    for setting in SETTINGS:
        p50 = statistics.median(r[setting]["shared"]["ttft_p50_s"] for r in rounds)
        mean = statistics.median(r[setting]["shared"]["ttft_mean_s"] for r in rounds)
        x = ratios(setting, lambda s: s["shared"]["ttft_p50_s"])
        tps = statistics.median(r[setting]["tokens_per_s"] for r in unique_rounds)
        cost = [r[setting]["tokens_per_s"] / r["pool"]["tokens_per_s"] for r in unique_rounds]
        rows.append([setting, f"{p50 * 1e3:.0f}", f"{mean * 1e3:.0f}", f"{statistics.median(x):.2f}",
                     " ".join(f"{v:.2f}" for v in x), str(rounds[-1][setting]["shared"]["tier_loaded_blocks"]),
                     f"{tps:.0f}", f"{statistics.median(cost):.3f}", " ".join(f"{v:.2f}" for v in cost)])
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_kv_offload", columns, rows, note=args.note,
                     title="The prefix cache's offload tier: TTFT on shared prefixes 4x the pool, cost with no reuse",
                     raw={"model": args.model, "pool_blocks": pool_blocks, "tier_bytes": tier_bytes,
                          "args": {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")},
                          "shared_rounds": rounds, "no_reuse_rounds": unique_rounds})


if __name__ == "__main__":
    main()
