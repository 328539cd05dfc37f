"""Prefix-aware routing with and without the cluster's KV index, on a Ray cluster of three nodes on
127.0.0.1 (tests/support/ray_nodes.py: the head with HAProxy and the KV index; workers a and b with
`--per-worker` engine replicas each, a prefix router on every node), measured in one run:

- **router's record** (`kv_cache_index: false`, today's default): each router replica remembers
  where it sent prefixes. HAProxy spreads its questions over the routers (one per node), so each
  sees only part of the traffic;
- **KV index** (`kv_cache_index: true`): the engines publish what their caches hold, and every
  router asks the index.

Each mode gets a fresh cluster and the same multi-turn workload: `--conversations` chats, each
`--turns` turns long, `--clients` of them at a time (closed loop, `--think-s` between an answer and
the next question). A turn's prompt is the shared
system text, the conversation so far (earlier prompts and answers) and a new question, sent as a
streamed `/v1/completions`. Reported per mode: the prefix-cache hit rate (prompt tokens served
from a cache / prompt tokens, summed over the workers' `qkv_prefix_cache_*` counters), the bound on
it for this run's order of requests (`reuse_bound`: what had been computed anywhere), TTFT p50
and p90, generated tokens per second, and the routers' own time per decision (the index lookup
included) from their histograms. Target: hit rate with the index >= 1.5x the router's
record, and a lower TTFT p50 at equal throughput.

    .venv/bin/python loadtests/benchmarks/bench_kv_index_routing.py --out docs/results/bench_kv_index_routing.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

BASE_PORT, HTTP_PORT = 19100, 19090  # the cluster's ports: 19100-19259 (tests/support/ray_nodes.py)
SYSTEM = ("You are the assistant of a small bakery. Answer questions about bread, cakes, opening hours "
          "and prices in one short sentence, politely, and never invent a product we do not sell.\n")
WORDS = ("bread", "rye", "cake", "open", "sunday", "price", "gluten", "butter", "croissant", "order", "today")
MODES = (("router's record", False), ("KV index", True))
BLOCK_SIZE = 16  # the app's (tests/support/ray_nodes.py)


def turn(http: requests.Session, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its text, TTFT and token counts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    text, ttft, usage = [], None, {}
    with http.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(choice["text"])
    return {"text": "".join(text), "ttft": ttft, "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0)}


def run_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The conversations, `args.clients` at a time; returns every turn's result and the wall time."""
    rng = random.Random(args.seed)
    questions = [[" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(args.turns)]
                 for _ in range(args.conversations)]
    todo = list(range(args.conversations))
    lock = threading.Lock()
    results: list[dict[str, Any]] = []

    def client() -> None:
        http = requests.Session()
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            prompt = f"{SYSTEM}Conversation {c}.\n"
            for t in range(args.turns):
                prompt += f"user: {questions[c][t]}\nassistant:"
                sent = time.time()
                out = turn(http, url, prompt, args.max_tokens)
                out |= {"prompt": prompt, "sent": sent, "ended": time.time()}
                prompt += out["text"] + "\n"
                time.sleep(args.think_s)  # the user reads the answer and types the next question
                with lock:
                    results.append(out | {"conversation": c, "turn": t})

    t0 = time.time()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"turns": results, "seconds": time.time() - t0}


def reuse_bound(turns: list[dict[str, Any]], block_size: int) -> int:
    """The prompt tokens any routing could have served from a cache, caches never evicting: for
    each request, the longest common prefix (in whole blocks, short of its last token) with the
    prompt of any request sent before it (its prefill may be done) or the prompt and answer of any
    that had ended before it. The tokenizer is byte-level: a token is a byte, after the few tokens
    it puts first (`prompt_tokens` minus the prompt's bytes)."""
    total = 0
    for r in turns:
        mine = r["prompt"].encode()
        best = 0
        for other in turns:
            if other is r or other["sent"] >= r["sent"]:
                continue
            theirs = (other["prompt"] + (other["text"] if other["ended"] < r["sent"] else "")).encode()
            n = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            best = max(best, n)
        first = r["prompt_tokens"] - len(mine)
        if best:
            total += min(best + first, r["prompt_tokens"] - 1) // block_size * block_size
    return total


def cache_counters(nodes: Any, expected_queries: int) -> tuple[float, float]:
    """(prompt tokens queried, prompt tokens hit), summed over the workers' metrics endpoints, once
    the queries add up to the workload's prompt tokens (Ray reports every second)."""
    from tests.support.ray_nodes import WORKERS
    from tests.support.serve_fixtures import metric_sum, scrape, wait_until

    def read() -> tuple[float, float] | None:
        samples = [s for w in WORKERS for s in scrape(f"http://127.0.0.1:{nodes.nodes[w].metrics_port}/metrics")]
        queries = metric_sum(samples, "ray_qkv_prefix_cache_queries_total")
        return (queries, metric_sum(samples, "ray_qkv_prefix_cache_hits_total")) if queries >= expected_queries else None

    return wait_until(read, 60, f"the workers' prefix-cache counters to reach {expected_queries} prompt tokens")


ROUTER_TIMES = ("ray_qkv_router_pick_seconds_sum", "ray_qkv_router_pick_seconds_count",
                "ray_qkv_router_index_lookup_seconds_sum", "ray_qkv_router_index_lookup_seconds_count")


def router_times(nodes: Any) -> dict[str, float]:
    """The routers' decision and index-lookup histograms' sums and counts, over every node."""
    from tests.support.serve_fixtures import metric_sum, scrape

    samples = [s for node in nodes.nodes.values() for s in scrape(f"http://127.0.0.1:{node.metrics_port}/metrics")]
    return {name: metric_sum(samples, name) for name in ROUTER_TIMES}


def one_mode(model: Path, kv_cache_index: bool, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.ray_nodes import index_replicas, start_serving_cluster
    from tests.support.serve_fixtures import wait_until

    nodes = start_serving_cluster(model, BASE_PORT, HTTP_PORT, per_worker=args.per_worker, kv_cache_index=kv_cache_index)
    try:
        if kv_cache_index:
            wait_until(lambda: index_replicas(nodes) == 2 * args.per_worker, 60, "every replica in the KV index")
        # The startup probe's prompt is in the counters: read them before, subtract after.
        base_q, base_h = cache_counters(nodes, 0)
        routed_before = router_times(nodes)
        out = run_workload(f"http://127.0.0.1:{HTTP_PORT}", args)
        prompt_tokens = sum(r["prompt_tokens"] for r in out["turns"])
        queries, hits = cache_counters(nodes, int(base_q) + prompt_tokens)
        # the routers' histograms reach the endpoints on Ray's next report (every second)
        routed = wait_until(lambda: (t := router_times(nodes))["ray_qkv_router_pick_seconds_count"]
                            >= routed_before["ray_qkv_router_pick_seconds_count"] + len(out["turns"]) and t, 60,
                            "the routers' decisions on the metrics endpoints")
        routed = {k: routed[k] - routed_before[k] for k in ROUTER_TIMES}
    finally:
        nodes.stop()
    ttfts = sorted(r["ttft"] for r in out["turns"] if r["ttft"] is not None)
    generated = sum(r["completion_tokens"] for r in out["turns"])
    bound = reuse_bound(out["turns"], BLOCK_SIZE)
    return {"requests": len(out["turns"]), "prompt_tokens": prompt_tokens, "queried": queries - base_q,
            "bound_hit_rate": bound / max(1, prompt_tokens),
            "hit_tokens": hits - base_h, "hit_rate": (hits - base_h) / max(1.0, queries - base_q),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
            "tokens_per_s": generated / out["seconds"], "seconds": out["seconds"],
            "router_decisions": routed["ray_qkv_router_pick_seconds_count"],
            "router_decision_ms_mean": 1000 * routed["ray_qkv_router_pick_seconds_sum"]
            / max(1.0, routed["ray_qkv_router_pick_seconds_count"]),
            "index_lookups": routed["ray_qkv_router_index_lookup_seconds_count"],
            "index_lookup_ms_mean": 1000 * routed["ray_qkv_router_index_lookup_seconds_sum"]
            / max(1.0, routed["ray_qkv_router_index_lookup_seconds_count"])}


def table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["routing", "requests", "prompt tokens", "hit rate", "bound (any routing)", "hit rate / router's record", "TTFT p50 (ms)",
               "TTFT p90 (ms)", "generated tokens/s", "target"]
    base = res["modes"][MODES[0][0]]
    rows = []
    for name, _ in MODES:
        m = res["modes"][name]
        ratio = m["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None
        target = None
        if name != MODES[0][0]:
            met = ratio is not None and ratio >= 1.5 and m["ttft_p50_ms"] < base["ttft_p50_ms"]
            target = "hit rate >= 1.5x, TTFT p50 lower: " + ("reached" if met else "not reached")
        rows.append([name, m["requests"], m["prompt_tokens"], f"{m['hit_rate']:.1%}", f"{m['bound_hit_rate']:.1%}",
                     None if ratio is None else round(ratio, 2), round(m["ttft_p50_ms"], 1),
                     round(m["ttft_p90_ms"], 1), round(m["tokens_per_s"], 1), target])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-worker", type=int, default=2, help="engine replicas on each of the two workers")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4, help="conversations at a time")
    ap.add_argument("--max-tokens", type=int, default=16, help="each answer's length")
    ap.add_argument("--think-s", type=float, default=0.5,
                    help="between an answer and the next turn (the engines publish their KV events every 0.25 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=256, help="the random model's width (its prefill is what a hit saves)")
    ap.add_argument("--n-layers", type=int, default=4)
    add_result_args(ap, None)
    args = ap.parse_args()
    from tests.support.local_serve import write_tiny_checkpoint

    res: dict[str, Any] = {"modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # A byte-level tokenizer: a conversation of six turns reaches ~700 tokens.
        model = write_tiny_checkpoint(Path(tmp) / "m", max_position=2048, d_model=args.d_model, n_heads=4,
                                      n_layers=args.n_layers, d_ff=4 * args.d_model)
        for name, kv_cache_index in MODES:
            res["modes"][name] = one_mode(model, kv_cache_index, args)
            print(name, json.dumps(res["modes"][name]), flush=True)
    res["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}
    columns, rows = table(res)
    print_table(columns, rows)
    router_columns = ["routing", "decisions", "decision (ms, mean)", "index lookups", "index lookup (ms, mean)"]
    router_rows = [[name, round(m["router_decisions"]), round(m["router_decision_ms_mean"], 2), round(m["index_lookups"]),
                    round(m["index_lookup_ms_mean"], 2) if m["index_lookups"] else None]
                   for name, m in res["modes"].items()]
    print_table(router_columns, router_rows)
    if args.out:
        write_result(args.out, "bench_kv_index_routing", columns, rows, raw=res, note=args.note,
                     title="Prefix routing on 2 nodes: the router's record against the KV index",
                     tables={"router": (router_columns, router_rows)})


if __name__ == "__main__":
    main()
