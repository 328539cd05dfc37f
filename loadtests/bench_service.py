"""The service end to end against the bare engine, in one run, on the same workload.

Workload: `bench_engine.py`'s (prompts of 32-256 token ids, max_tokens 16-256, greedy,
ignore_eos) on each `--model` (random weights: the paper's base Transformer and the GPT-2-small
shape by default), kept `--concurrency` requests in flight (closed loop; 1, 16 and 32 clients
by default), the service once per `--stream-interval-ms` value.
- bare engine: `Engine` driven directly in a Ray worker, a process like the service's replica
  (Ray sets OMP_NUM_THREADS and a nice level for its workers, which changes CPU throughput), so
  the comparison isolates the HTTP/Serve path; a new request is added as soon as one finishes;
  TTFT and inter-token latency from the engine's own timestamps;
- service: `build_app` on a local Ray Serve (127.0.0.1 only), `--concurrency` streaming
  `/v1/completions` clients; TTFT is request sent -> first chunk, ITL the gaps between chunks.
Both use the same torch thread count. With `--rounds N` the whole run repeats N times and the
table shows each side's best round (a shared machine's other load only ever slows a round
down); every round is in the JSON. Prints a table and writes JSON.

    .venv/bin/python loadtests/bench_service.py [--model transformer-base gpt2-small-random]
        [--concurrency 1 16 32] [--stream-interval-ms 0 50] [--rounds 1] [--out results/bench_service.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # local_serve: test scaffolding

from bench_engine import PRESET, workload  # noqa: E402

from model.config import PRESETS, EngineConfig  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402
from model.sampling.params import SamplingParams  # noqa: E402
from local_serve import local_service  # noqa: E402
from service.app import AppArgs, compose_app  # noqa: E402

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
    first: dict[str, float] = {}
    tpots: list[float] = []
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
                    first[out.request_id] = t
                last[out.request_id] = t
            if out.finished:
                in_flight -= 1
                if out.num_output_tokens > 1:
                    tpots.append((last[out.request_id] - first[out.request_id]) / (out.num_output_tokens - 1))
    secs = time.perf_counter() - t0
    assert produced == sum(max_tokens), "the engine did not produce every requested token"
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "tpot_s": percentiles(tpots)}


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
    # per request: (last chunk - first chunk) / (tokens - 1), however the tokens were grouped
    tpots = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "tpot_s": percentiles(tpots), "tokens_per_chunk": produced / chunks}


def requests_for(concurrency: int, most: int) -> int:
    """Requests per run: enough to keep `concurrency` clients busy a while, 8 to `most`."""
    return min(most, max(8, 4 * concurrency))


def report(res: dict[str, Any]) -> None:
    print(f"\n{res['threads']} torch threads; best of {res['num_rounds']} round(s); chunk gap = time between "
          "streamed chunks (several tokens when merged)")
    print("| model | clients | requests | path | tok/s | vs engine | TTFT p50 | TTFT p99 | TPOT p50 | gap p50 | "
          "gap p99 | tokens/chunk |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in res["table"]:
        e = row["engine"]
        print(f"| {row['model']} | {row['concurrency']} | {row['requests']} | bare engine | {e['tokens_per_s']:.1f} | "
              f"1.00x | {e['ttft_s']['p50'] * 1e3:.0f} ms | {e['ttft_s']['p99'] * 1e3:.0f} ms | "
              f"{e['tpot_s']['p50'] * 1e3:.1f} ms | {e['itl_s']['p50'] * 1e3:.0f} ms | {e['itl_s']['p99'] * 1e3:.0f} ms | 1.00 |")
        for interval, s in row["service"].items():
            print(f"| {row['model']} | {row['concurrency']} | {row['requests']} | service, stream_interval_ms "
                  f"{interval} | {s['tokens_per_s']:.1f} | {s['tokens_per_s'] / e['tokens_per_s']:.2f}x | "
                  f"{s['ttft_s']['p50'] * 1e3:.0f} ms | {s['ttft_s']['p99'] * 1e3:.0f} ms | "
                  f"{s['tpot_s']['p50'] * 1e3:.1f} ms | {s['itl_s']['p50'] * 1e3:.0f} ms | {s['itl_s']['p99'] * 1e3:.0f} ms | "
                  f"{s['tokens_per_chunk']:.2f} |")


def bench_model(name: str, args: argparse.Namespace, res: dict[str, Any]) -> None:
    """One model: the bare engine and the service (once per stream interval) at every
    concurrency, `--rounds` times, in one local Ray."""
    tmp = tempfile.mkdtemp(prefix="qkv-bench-service-")
    save_model(build_preset(name), tmp)
    top = max(args.concurrency)
    config = EngineConfig(max_num_seqs=max(64, top), max_num_batched_tokens=2048, kv_cache_bytes=3 << 30)
    vocab = PRESETS[name].vocab_size
    loads = {c: workload(requests_for(c, args.max_requests), args.seed, vocab) for c in args.concurrency}
    service_args = {"model": tmp, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": config.max_num_batched_tokens,
                    "kv_cache_bytes": config.kv_cache_bytes, "engine_num_cpus": 1, "torch_threads": args.threads,
                    "stream_interval_ms": args.stream_interval_ms[0]}
    rounds: list[dict] = []
    # Logical CPUs: the bare engine's worker, and old and new replicas side by side while a
    # changed stream interval is redeployed.
    with local_service(service_args, HTTP_PORT, num_cpus=6) as url:
        engine = ray.remote(num_cpus=1)(BareEngine).remote(tmp, config, args.threads)
        for k in range(args.rounds):
            one: dict[str, Any] = {"engine": {}, "service": {}}
            for c, (prompts, max_tokens) in loads.items():
                one["engine"][c] = ray.get(engine.run.remote(prompts, max_tokens, c))
                print(f"{name} round {k + 1}: bare engine, {c} clients: {one['engine'][c]['tokens_per_s']:.1f} tok/s",
                      flush=True)
            for interval in args.stream_interval_ms:
                if (k, interval) != (0, args.stream_interval_ms[0]):
                    app = compose_app(AppArgs.model_validate(service_args | {"stream_interval_ms": interval}))
                    serve.run(app, name="qkv", route_prefix="/")
                for c, (prompts, max_tokens) in loads.items():
                    served = run_service(url, prompts, max_tokens, c)
                    one["service"].setdefault(str(interval), {})[c] = served
                    print(f"{name} round {k + 1}: service, stream_interval_ms {interval}, {c} clients: "
                          f"{served['tokens_per_s']:.1f} tok/s, {served['tokens_per_chunk']:.2f} tokens/chunk",
                          flush=True)
            rounds.append(one)
    best = lambda runs: max(runs, key=lambda r: r["tokens_per_s"])  # noqa: E731 - load only ever slows a round
    for c in args.concurrency:
        res["table"].append({
            "model": name, "concurrency": c, "requests": requests_for(c, args.max_requests),
            "engine": best([r["engine"][c] for r in rounds]),
            "service": {str(i): best([r["service"][str(i)][c] for r in rounds]) for i in args.stream_interval_ms},
        })
    res["rounds"][name] = rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["transformer-base", PRESET], choices=list(PRESETS),
                    help="random-weight presets to serve (a trained one runs at the same speed as its shape)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="streaming clients")
    ap.add_argument("--max-requests", type=int, default=64, help="per run: 4 x clients, at least 8, at most this")
    ap.add_argument("--stream-interval-ms", type=float, nargs="+", default=[0.0, 50.0],
                    help="the service's stream_interval_ms values to compare")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_service.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"threads": args.threads, "num_rounds": args.rounds, "table": [], "rounds": {},
                           "load_average_start": os.getloadavg()}
    for name in args.model:
        bench_model(name, args, res)
    res["load_average_end"] = os.getloadavg()
    report(res)
    print(f"load average: {res['load_average_start'][0]:.2f} at the start, {res['load_average_end'][0]:.2f} at the end")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
