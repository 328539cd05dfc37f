"""The service end to end against the bare engine, in one run, on the same workload.

Workload: `bench_engine.py`'s (GPT-2-small-shaped random weights, prompts of 32-256 token ids,
max_tokens 16-256, greedy, ignore_eos), kept `--concurrency` requests in flight (closed loop).
- bare engine: `Engine` driven directly in a Ray worker, a process like the service's replica
  (Ray sets OMP_NUM_THREADS and a nice level for its workers, which changes CPU throughput), so
  the comparison isolates the HTTP/Serve path; a new request is added as soon as one finishes;
  TTFT and inter-token latency from the engine's own timestamps;
- service: `build_app` on a local Ray Serve (127.0.0.1 only), `--concurrency` streaming
  `/v1/completions` clients; TTFT is request sent -> first chunk, ITL the gaps between chunks.
Both use the same torch thread count. With `--rounds N` the two alternate N times and the
table shows each side's best round (a shared machine's other load only ever slows a round
down); every round is in the JSON. Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_service.py [--requests 64] [--concurrency 32] [--rounds 1]
        [--out results/bench_service.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # local_serve: test scaffolding

from bench_engine import PRESET, workload  # noqa: E402

from model.checkpoint import save_model  # noqa: E402
from model.config import PRESETS, EngineConfig  # noqa: E402
from model.engine import Engine  # noqa: E402
from model.loading import build_preset  # noqa: E402
from model.sampling_params import SamplingParams  # noqa: E402
from local_serve import local_service  # noqa: E402

HTTP_PORT = 18400


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> dict[str, Any]:
    engine.add_request("warmup", prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    pending = list(range(len(prompts)))
    ttft, itl, last, produced = [], [], {}, 0
    t0 = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i = pending.pop(0)
            engine.add_request(f"{time.monotonic_ns()}-{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0.0,
                                                                   ignore_eos=True))
            in_flight += 1
        for out in engine.step():
            produced += len(out.new_token_ids)
            for t in out.token_times:
                if out.request_id in last:
                    itl.append(t - last[out.request_id])
                else:
                    ttft.append(t - out.times.arrival)
                last[out.request_id] = t
            if out.finished:
                in_flight -= 1
    secs = time.perf_counter() - t0
    assert produced == sum(max_tokens), "the engine did not produce every requested token"
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl)}


class BareEngine:
    """The engine alone, hosted in a Ray worker (see the module docstring)."""

    def __init__(self, model_dir: str, config: EngineConfig, threads: int) -> None:
        torch.set_num_threads(threads)
        self.engine = Engine(model_dir, config, device="cpu", dtype="float32")

    def run(self, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> dict[str, Any]:
        return run_engine(self.engine, prompts, max_tokens, concurrency)


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk["choices"]:
                chunk_times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"sent": sent, "chunks": chunk_times, "tokens": usage["completion_tokens"]}


async def _clients(url: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> list[dict]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await _one(client, prompts[i], max_tokens[i]))

        await _one(client, prompts[0][:8], 4)  # warm-up
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def run_service(url: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = asyncio.run(_clients(url, prompts, max_tokens, concurrency))
    secs = time.perf_counter() - t0
    produced = sum(r["tokens"] for r in results)
    assert produced == sum(max_tokens), "the service did not produce every requested token"
    ttft = [r["chunks"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    chunks = sum(len(r["chunks"]) for r in results)
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "tokens_per_chunk": produced / chunks}


def report(res: dict[str, Any]) -> None:
    e, s = res["engine"], res["service"]
    print(f"\n{res['requests']} requests, {res['concurrency']} in flight, {PRESET}, {res['threads']} torch threads, "
          f"{res['output_tokens']} output tokens; best of {len(res['rounds'])} round(s)")
    print(f"| {'':<22} | {'tok/s':>7} | {'req/s':>6} | {'TTFT p50':>9} | {'TTFT p99':>9} | {'ITL p50':>8} | "
          f"{'ITL p99':>8} |")
    print(f"|{'-' * 24}|{'-' * 9}|{'-' * 8}|{'-' * 11}|{'-' * 11}|{'-' * 10}|{'-' * 10}|")
    for name, r in (("bare engine", e), ("service (HTTP, stream)", s)):
        print(f"| {name:<22} | {r['tokens_per_s']:>7.1f} | {r['requests_per_s']:>6.2f} | "
              f"{r['ttft_s']['p50'] * 1e3:>7.0f}ms | {r['ttft_s']['p99'] * 1e3:>7.0f}ms | "
              f"{r['itl_s']['p50'] * 1e3:>6.0f}ms | {r['itl_s']['p99'] * 1e3:>6.0f}ms |")
    print(f"service / engine throughput: {res['service_over_engine']:.2f} (target >= 0.80); "
          f"{s['tokens_per_chunk']:.2f} tokens per streamed chunk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_service.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="qkv-bench-service-")
    save_model(build_preset(PRESET), tmp)
    config = EngineConfig(max_num_seqs=max(64, args.concurrency), max_num_batched_tokens=2048,
                          kv_cache_bytes=3 << 30)
    vocab = PRESETS[PRESET].vocab_size
    prompts, max_tokens = workload(args.requests, args.seed, vocab)
    res: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency, "threads": args.threads,
                           "model": PRESET, "output_tokens": sum(max_tokens), "rounds": []}
    service_args = {"model": tmp, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": config.max_num_batched_tokens,
                    "kv_cache_bytes": config.kv_cache_bytes, "engine_num_cpus": 1, "torch_threads": args.threads}
    # Logical CPUs: room for the bare engine's worker beside the service's replicas.
    with local_service(service_args, HTTP_PORT, num_cpus=4) as url:
        engine = ray.remote(num_cpus=1)(BareEngine).remote(tmp, config, args.threads)
        for k in range(args.rounds):
            bare = ray.get(engine.run.remote(prompts, max_tokens, args.concurrency))
            served = run_service(url, prompts, max_tokens, args.concurrency)
            res["rounds"].append({"engine": bare, "service": served})
            print(f"round {k + 1}: bare engine {bare['tokens_per_s']:.1f} tok/s, "
                  f"service {served['tokens_per_s']:.1f} tok/s", flush=True)
    for side in ("engine", "service"):
        res[side] = max((r[side] for r in res["rounds"]), key=lambda r: r["tokens_per_s"])
    res["service_over_engine"] = res["service"]["tokens_per_s"] / res["engine"]["tokens_per_s"]
    report(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
