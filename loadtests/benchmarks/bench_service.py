"""The service end to end against the bare engine, in one run, on the same workload, with
where the serving path's CPU goes.

Workload: the engine benchmarks' (loadtests/lib/workloads.py: prompts of 32-256 token ids, max_tokens 16-256, greedy,
ignore_eos) on each `--model` (random weights: the paper's base Transformer, which runs as fast
as `transformer-base-trained`, and the GPT-2-small shape by default), kept `--concurrency`
requests in flight (closed loop; 1, 16 and 32 clients by default).
- bare engine: `Engine` driven directly in a Ray worker, a process like the service's replica
  (Ray sets OMP_NUM_THREADS and a nice level for its workers, which changes CPU throughput), so
  the comparison isolates the HTTP/Serve path; a new request is added as soon as one finishes;
  TTFT and inter-token latency from the engine's own timestamps;
- service: `build_app` on a local Ray Serve (127.0.0.1 only), `--concurrency` streaming
  `/v1/completions` clients; TTFT is request sent -> first chunk, ITL the gaps between chunks
  (a chunk carries several tokens when a client lags and deltas merge: see tokens/chunk).
- CPU per generated token of every process of the service over the service run (psutil, user +
  system), the engine replica split into its step (the threads named `qkv-step`: the step thread
  and the torch workers it started) and the rest of it (the HTTP edge, Ray's threads); "serving
  path" sums what is on the token path except the step (HAProxy, the engine replica's edge, the
  prefix router, and without HAProxy Serve's Python proxy; the old layout's ingress replica);
  Ray's own daemons (GCS, raylet, controller, dashboard), the HAProxy manager and, with
  HAProxy, the idle fallback proxy are shown apart, and so are the clients (this process),
  which share the machine's cores with the service but not with the bare engine. The bare
  engine's whole process is measured the same way, to set beside the service's engine step.
Both sides use the same torch thread count. Ray Serve's settings come from
`service.launch.SERVING_ENV` (HAProxy by default) with `--env KEY=VALUE` on top, e.g.
`--env RAY_SERVE_ENABLE_HA_PROXY=0` for Serve's Python proxy. With `--rounds N` the whole run
repeats N times (3 by default) and the table shows, per model and client count, the round whose
service/engine ratio is the median, with every round's ratio; every round is in the JSON.

    .venv/bin/python loadtests/benchmarks/bench_service.py [--model transformer-base gpt2-small-random]
        [--concurrency 1 16 32] [--threads 2] [--env KEY=VALUE ...] [--rounds 1]
        [--out results/bench_service.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.serve_env import apply_serving_env  # noqa: E402

SERVE_ENV = apply_serving_env(sys.argv)  # before Ray Serve is imported

import psutil  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from loadtests.lib.checkpoints import PRESET  # noqa: E402
from loadtests.lib.process_cpu import cpu_snapshot, cpu_used  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.streaming_clients import percentiles, requests_for, run_service  # noqa: E402
from loadtests.lib.workloads import workload  # noqa: E402
from model.config import PRESETS, EngineConfig  # noqa: E402
from model.engine.builder import build_engine
from model.engine.engine import Engine  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402
from model.sampling.params import SamplingParams  # noqa: E402
from tests.support.local_serve import local_service  # noqa: E402

HTTP_PORT = 18400


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> dict[str, Any]:
    engine.add_request("warmup", prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    pending = list(range(len(prompts)))
    ttft, itl, last, produced = [], [], {}, 0
    first: dict[str, float] = {}
    tpots: list[float] = []
    t0, cpu0 = time.perf_counter(), psutil.Process().cpu_times()
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
    secs, cpu1 = time.perf_counter() - t0, psutil.Process().cpu_times()
    assert produced == sum(max_tokens), "the engine did not produce every requested token"
    # the whole worker process (its step and torch's threads, Ray's few): to set beside the service's `engine step`
    cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "tpot_s": percentiles(tpots),
            "cpu": {"cpu_s": cpu_s, "ms_per_token": cpu_s * 1e3 / produced, "core_share": cpu_s / secs}}


class BareEngine:
    """The engine alone, hosted in a Ray worker (see the module docstring)."""

    def __init__(self, model_dir: str, config: EngineConfig, threads: int) -> None:
        torch.set_num_threads(threads)
        self.engine = build_engine(model_dir, config, device="cpu", dtype="float32")

    def run(self, prompts: list[list[int]], max_tokens: list[int], concurrency: int) -> dict[str, Any]:
        return run_engine(self.engine, prompts, max_tokens, concurrency)


def table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The main table: each model and client count, the bare engine's row and the service's."""
    columns = ["model", "clients", "path", "tok/s", "vs engine", "rounds' ratios", "TTFT p50", "TTFT p99", "ITL p50",
               "ITL p99", "tokens/chunk", "serving CPU ms/token"]
    ms = lambda d, q: f"{d[q] * 1e3:.1f} ms"  # noqa: E731
    rows = []
    for row in res["table"]:
        e, s = row["engine"], row["service"]
        rows.append([row["model"], str(row["concurrency"]), "bare engine", f"{e['tokens_per_s']:.1f}", "1.00x", "",
                     ms(e["ttft_s"], "p50"), ms(e["ttft_s"], "p99"), ms(e["itl_s"], "p50"), ms(e["itl_s"], "p99"),
                     "1.00", ""])
        rows.append([row["model"], str(row["concurrency"]), "service", f"{s['tokens_per_s']:.1f}",
                     f"{s['tokens_per_s'] / e['tokens_per_s']:.2f}x", " ".join(f"{x:.2f}" for x in row["ratios"]),
                     ms(s["ttft_s"], "p50"), ms(s["ttft_s"], "p99"),
                     ms(s["itl_s"], "p50"), ms(s["itl_s"], "p99"), f"{s['tokens_per_chunk']:.2f}",
                     f"{s['cpu']['serving path']['ms_per_token']:.3f}"])
    return columns, rows


def cpu_table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """CPU per generated token by process in the service runs (the median rounds), the bare
    engine's whole process beside them: ms/token (share of one core)."""
    names = sorted({n for row in res["table"] for n in row["service"]["cpu"]},
                   key=lambda n: (n in ("serving path", "engine step", "Ray's own", "benchmark clients"), n))
    columns = ["model", "clients", *names, "bare engine's process"]
    cell = lambda c: f"{c['ms_per_token']:.3f} ({c['core_share']:.0%})"  # noqa: E731
    rows = [[row["model"], str(row["concurrency"]), *(cell(row["service"]["cpu"][n]) if n in row["service"]["cpu"]
                                                       else "" for n in names), cell(row["engine"]["cpu"])]
            for row in res["table"]]
    return columns, rows


def report(res: dict[str, Any]) -> None:
    print(f"\n{res['threads']} torch threads; the median of {res['num_rounds']} round(s); Serve settings: "
          + ", ".join(f"{k}={v}" for k, v in sorted(res["serve_env"].items())))
    print_table(*table(res))
    print("\nCPU per generated token by process (ms/token, share of one core), service runs:")
    print_table(*cpu_table(res))


def bench_model(name: str, args: argparse.Namespace, res: dict[str, Any]) -> None:
    """One model: the bare engine and the service at every concurrency, `--rounds` times, in one
    local Ray."""
    tmp = tempfile.mkdtemp(prefix="qkv-bench-service-")
    save_model(build_preset(name), tmp)
    top = max(args.concurrency)
    config = EngineConfig(max_num_seqs=max(64, top), max_num_batched_tokens=2048, kv_cache_memory_bytes=3 << 30)
    vocab = PRESETS[name].vocab_size
    loads = {c: workload(requests_for(c, args.max_requests), args.seed, vocab) for c in args.concurrency}
    service_args = {"model": tmp, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": config.max_num_batched_tokens,
                    "kv_cache_memory_bytes": config.kv_cache_memory_bytes, "engine_num_cpus": 1, "torch_threads": args.threads}
    rounds: list[dict] = []
    with local_service(service_args, HTTP_PORT, num_cpus=4) as url:
        engine = ray.remote(num_cpus=1)(BareEngine).remote(tmp, config, args.threads)
        for k in range(args.rounds):
            one: dict[str, Any] = {"engine": {}, "service": {}}
            # Each client count's two sides back to back, so that a shared machine's drift in
            # speed between them stays small.
            for c, (prompts, max_tokens) in loads.items():
                one["engine"][c] = ray.get(engine.run.remote(prompts, max_tokens, c))
                print(f"{name} round {k + 1}: bare engine, {c} clients: {one['engine'][c]['tokens_per_s']:.1f} tok/s",
                      flush=True)
                before, t0 = cpu_snapshot(), time.perf_counter()
                served = run_service(url, prompts, max_tokens, c)
                wall, after = time.perf_counter() - t0, cpu_snapshot()
                served["cpu"] = cpu_used(before, after, served["output_tokens"], wall)
                one["service"][c] = served
                print(f"{name} round {k + 1}: service, {c} clients: {served['tokens_per_s']:.1f} tok/s, "
                      f"{served['tokens_per_chunk']:.2f} tokens/chunk, serving path "
                      f"{served['cpu']['serving path']['ms_per_token']:.3f} ms CPU/token", flush=True)
            rounds.append(one)
    for c in args.concurrency:
        # The round whose service/engine ratio is the median: a shared machine's drift moves whole
        # rounds, and each round's two sides ran back to back.
        ratios = [r["service"][c]["tokens_per_s"] / r["engine"][c]["tokens_per_s"] for r in rounds]
        median = sorted(range(len(rounds)), key=lambda k: ratios[k])[len(rounds) // 2]
        res["table"].append({"model": name, "concurrency": c, "requests": requests_for(c, args.max_requests),
                             "engine": rounds[median]["engine"][c], "service": rounds[median]["service"][c],
                             "ratios": ratios})
    res["rounds"][name] = rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["transformer-base", PRESET], choices=list(PRESETS),
                    help="random-weight presets to serve (a trained one runs at the same speed as its shape)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32], help="streaming clients")
    ap.add_argument("--max-requests", type=int, default=64, help="per run: 4 x clients, at least 8, at most this")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the engine (both sides)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="Ray Serve settings on top of service.launch.SERVING_ENV (applied before Ray starts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_result_args(ap, "results/bench_service.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"threads": args.threads, "num_rounds": args.rounds, "serve_env": SERVE_ENV,
                           "table": [], "rounds": {}, "load_average_start": os.getloadavg()}
    for name in args.model:
        bench_model(name, args, res)
    res["load_average_end"] = os.getloadavg()
    report(res)
    print(f"load average: {res['load_average_start'][0]:.2f} at the start, {res['load_average_end'][0]:.2f} at the end")
    if args.out:
        columns, rows = table(res)
        write_result(args.out, "bench_service", columns, rows, raw=res, note=args.note, tables={"cpu": cpu_table(res)},
                     title=f"The service against the bare engine, the median of {args.rounds} round(s)")


if __name__ == "__main__":
    main()
