"""Cross-node prefix fetch (`kv_remote_fetch`) against recompute, on a Ray cluster of three nodes on
127.0.0.1 (tests/support/ray_nodes.py: the head with HAProxy and the KV index; workers a and b
with one engine replica each), in one run.

Each round, one request at a time, straight to a replica's HTTP edge (past the router, which
would send a prompt to the replica that holds it):
- the holder (a, then b, alternately) computes a prompt of `--prompt-tokens` random token ids;
  after `--settle-s` (its KV events reach the index within 0.25 s) ...
- **fetched**: the same prompt goes to the other replica, which finds it in the index, fetches
  the blocks from the holder's pool across the nodes and computes only the last block;
- **recomputed**: a prompt nobody has seen, of the same length, goes to that same replica.

Both are streamed with `max_tokens: 1`; TTFT is the client's time to the first token. Reported:
the medians, their ratio (target: >= 3x), and from the fetching replicas' counters the blocks,
bytes and seconds the fetches took. The model is the GPT-2-small preset with random weights
(loadtests/lib/checkpoints.py), float32 on the CPU, one torch thread per replica.

    .venv/bin/python loadtests/benchmarks/bench_kv_remote_fetch.py --out docs/results/bench_kv_remote_fetch.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

BASE_PORT, HTTP_PORT = 19100, 19090  # the cluster's ports: 19100-19259 (tests/support/ray_nodes.py)
MODEL = "gpt2-small-random"
VOCAB = 50257


def ttft(url: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed one-token completion to its first token."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") is not None for c in chunk.get("choices") or []):
                    return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def fetch_counters(nodes: Any) -> dict[str, float]:
    """The fetch counters summed over the workers' metrics endpoints."""
    from tests.support.ray_nodes import WORKERS
    from tests.support.serve_fixtures import metric_sum, scrape

    names = {"blocks": "ray_qkv_kv_remote_fetch_blocks_total", "bytes": "ray_qkv_kv_remote_fetch_bytes_total",
             "seconds": "ray_qkv_kv_remote_fetch_seconds_sum", "fetches": "ray_qkv_kv_remote_fetch_seconds_count",
             "fallbacks": "ray_qkv_kv_remote_fetch_fallbacks_total"}
    totals = dict.fromkeys(names, 0.0)
    for worker in WORKERS:
        samples = scrape(f"http://127.0.0.1:{nodes.nodes[worker].metrics_port}/metrics")
        for key, name in names.items():
            totals[key] += metric_sum(samples, name)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--settle-s", type=float, default=1.0, help="wait after the holder computed a prompt")
    ap.add_argument("--seed", type=int, default=0)
    add_result_args(ap, None)
    args = ap.parse_args()
    from loadtests.lib.checkpoints import checkpoint
    from tests.support.ray_nodes import WORKERS, replica_urls, start_serving_cluster
    from tests.support.serve_fixtures import wait_until

    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(1, VOCAB - 1) for _ in range(args.prompt_tokens)]

    app_args = {"kv_remote_fetch": True, "kv_remote_fetch_min_tokens": 256, "num_kv_blocks": 640,
                "dtype": "float32", "max_num_seqs": 4}
    times: dict[str, list[float]] = {"fetched": [], "recomputed": []}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(MODEL, tmp)
        nodes = start_serving_cluster(Path(tmp), BASE_PORT, HTTP_PORT, app_args=app_args)
        try:
            wait_until(lambda: set(replica_urls(nodes)) == set(WORKERS), 60, "both replicas' HTTP edges")
            urls = replica_urls(nodes)
            # Warm-up, each way: a replica's first fetch also makes its handle to the peers and
            # measures its link, and its first long prompt measures its prefill rate.
            for holder, other in (WORKERS, WORKERS[::-1]):
                shared = prompt()
                ttft(urls[holder], shared)
                time.sleep(args.settle_s)
                ttft(urls[other], shared)
                ttft(urls[other], prompt())
            before = fetch_counters(nodes)
            for i in range(args.rounds):
                holder, other = WORKERS[i % 2], WORKERS[(i + 1) % 2]
                shared = prompt()
                ttft(urls[holder], shared)
                time.sleep(args.settle_s)
                times["fetched"].append(ttft(urls[other], shared))
                times["recomputed"].append(ttft(urls[other], prompt()))
                print(f"round {i}: holder {holder}, fetched {times['fetched'][-1] * 1000:.0f} ms, "
                      f"recomputed {times['recomputed'][-1] * 1000:.0f} ms", flush=True)
            time.sleep(3)  # the replicas' last counters reach their nodes' metrics endpoints
            after = fetch_counters(nodes)
        finally:
            nodes.stop()
    counters = {k: after[k] - before[k] for k in after}
    fetched, recomputed = statistics.median(times["fetched"]), statistics.median(times["recomputed"])
    fetches = max(counters["fetches"], 1.0)
    columns = ["prompt tokens", "TTFT recomputed (ms)", "TTFT fetched (ms)", "recomputed / fetched",
               "fetches", "blocks per fetch", "MB per fetch", "fetch (ms, mean)", "fallbacks"]
    rows = [[args.prompt_tokens, f"{recomputed * 1000:.0f}", f"{fetched * 1000:.0f}", f"{recomputed / fetched:.1f}x",
             f"{counters['fetches']:.0f}", f"{counters['blocks'] / fetches:.0f}",
             f"{counters['bytes'] / fetches / 1e6:.1f}", f"{counters['seconds'] / fetches * 1000:.0f}",
             f"{counters['fallbacks']:.0f}"]]
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_kv_remote_fetch", columns, rows,
                     raw={"times_s": times, "counters": counters,
                          "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")},
                          "app_args": app_args},
                     note=args.note,
                     title=f"{MODEL}: a {args.prompt_tokens}-token prompt another node's replica holds, fetched "
                           "from it vs recomputed; medians of one request at a time over a three-node Ray "
                           "cluster on loopback")


if __name__ == "__main__":
    main()
