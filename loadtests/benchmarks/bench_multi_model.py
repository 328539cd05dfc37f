"""What serving a model inside a multi-model app costs per token against serving it alone, in
each of the multi-model layouts (service/app/multi.py), on one local Ray, on `bench_service.py`'s
workload and client (streaming `/v1/completions` naming the model, closed loop at each
`--concurrency`):

- direct: a one-model app (HAProxy straight to the engine replica's own HTTP edge);
- one deployment: a `models:` app of the model and a second, tiny model (the default layout):
  HAProxy asks the prefix router for each request's replica (a replica of the model the body
  names) and goes straight to it;
- front: the same two models with options that need deployments of their own, behind the
  ModelRouter front (HAProxy -> front -> streaming handle -> the replica's edge).

Each round deploys the three apps in turn; a path's figure is the median over rounds of its
ratio to the same round's direct run. Per path: tokens/s, TTFT and inter-chunk latency
percentiles, tokens per SSE chunk, and CPU per generated token of the serving path (HAProxy, the
engine replicas outside their step, the prefix router, the front), with the router's and the
front's shares shown apart.

    .venv/bin/python loadtests/benchmarks/bench_multi_model.py [--model transformer-base] [--concurrency 1 16]
        [--threads 2] [--rounds 3] [--out results/bench_multi_model.json]
    .venv/bin/python loadtests/benchmarks/bench_multi_model.py --quick   # tiny model, a few requests: checks it runs
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.serve_env import apply_serving_env  # noqa: E402

SERVE_ENV = apply_serving_env(sys.argv)  # before Ray Serve is imported

import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402

from loadtests.lib.process_cpu import cpu_snapshot, cpu_used, service_role  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.streaming_clients import requests_for, run_service  # noqa: E402
from loadtests.lib.workloads import workload  # noqa: E402
from model.config import PRESETS  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402

HTTP_PORT = 18410
FRONT = "multi-model front"
ROUTER = "prefix router"  # process_cpu.service_role's name for the PrefixRoute process
PATHS = {"direct": "direct (HAProxy -> replica)", "one deployment": "one deployment (HAProxy -> replica of the model)",
         "front": "front (HAProxy -> front -> replica)"}


def role(cmdline: str, name: str) -> str | None:
    """The service's parts (loadtests/lib/process_cpu.py), and the front."""
    return FRONT if "ModelRouter" in cmdline else service_role(cmdline, name)


def tiny_checkpoint(directory: str) -> str:
    from model.config import ModelConfig
    from model.models.transformer import Transformer

    cfg = ModelConfig(d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=512)
    net = Transformer(cfg)
    net.init_weights(cfg.init_seed)
    save_model(net, directory)
    return directory


def serve_and_measure(path: str, app_args: dict[str, Any],
                      loads: dict[int, tuple[list[list[int]], list[int]]]) -> dict[int, Any]:
    from service.app import build_app

    serve.run(build_app(app_args), name="qkv", route_prefix="/")
    url = f"http://127.0.0.1:{HTTP_PORT}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=5).ok:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    out = {}
    try:
        for c, (prompts, max_tokens) in loads.items():
            run_service(url, prompts[:2], [4, 4], 1, model="bench")  # warm the path (first request's set-up)
            before, t0 = cpu_snapshot(role), time.perf_counter()
            served = run_service(url, prompts, max_tokens, c, model="bench")
            wall, after = time.perf_counter() - t0, cpu_snapshot(role)
            served["cpu"] = cpu_used(before, after, served["output_tokens"], wall)
            out[c] = served
            print(f"{path}, {c} clients: {served['tokens_per_s']:.1f} tok/s, "
                  f"{served['tokens_per_chunk']:.2f} tokens/chunk", flush=True)
    finally:
        serve.delete("qkv")
    return out


def table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per client count and path: the median round's figures, and the median of per-round ratios to direct."""
    columns = ["clients", "path", "tok/s", "vs direct", "rounds' ratios", "TTFT p50", "ITL p50", "ITL p99",
               "tokens/chunk", "serving CPU ms/token", "of it router + front"]
    ms = lambda d, q: f"{d[q] * 1e3:.1f} ms"  # noqa: E731
    rows = []
    rounds = res["rounds"]
    for c in rounds[0]["direct"]:
        for path, label in PATHS.items():
            runs = [r[path][c] for r in rounds]
            ratios = [r[path][c]["tokens_per_s"] / r["direct"][c]["tokens_per_s"] for r in rounds]
            median = sorted(runs, key=lambda x: x["tokens_per_s"])[len(runs) // 2]
            extra = sum(median["cpu"].get(part, {}).get("ms_per_token", 0.0) for part in (FRONT, ROUTER))
            rows.append([str(c), label, f"{median['tokens_per_s']:.1f}", f"{statistics.median(ratios):.2f}x",
                         " ".join(f"{x:.2f}" for x in ratios), ms(median["ttft_s"], "p50"), ms(median["itl_s"], "p50"),
                         ms(median["itl_s"], "p99"), f"{median['tokens_per_chunk']:.2f}",
                         f"{median['cpu']['serving path']['ms_per_token']:.3f}", f"{extra:.3f}"])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer-base", choices=list(PRESETS), help="a random-weight preset")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="each round deploys and measures the three paths")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 4 short requests at 1 and 4 clients")
    add_result_args(ap, "results/bench_multi_model.json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qkv-bench-multi-")
    if args.quick:
        model, vocab = tiny_checkpoint(tmp), 256
        concurrency, n_requests = [1, 4], (lambda c: 4)
    else:
        save_model(build_preset(args.model), tmp)
        model, vocab = tmp, PRESETS[args.model].vocab_size
        concurrency, n_requests = args.concurrency, (lambda c: requests_for(c, args.max_requests))
    loads = {}
    for c in concurrency:
        prompts, max_tokens = workload(n_requests(c), args.seed, vocab)
        loads[c] = (prompts, [16 for _ in max_tokens] if args.quick else max_tokens)
    one = {"model": model, "served_model_name": "bench", "accelerator": "cpu", "dtype": "float32", "max_num_seqs": 64,
           "engine_num_cpus": 1 if not args.quick else 0.5, "torch_threads": args.threads}
    second = {**one, "model": tiny_checkpoint(tempfile.mkdtemp(prefix="qkv-bench-second-")),
              "served_model_name": "second", "torch_threads": 1}
    apps = {"direct": one,
            "one deployment": {"models": [one, second], "router_num_cpus": 0.25},
            # Another replica CPU count for the second model: entries that one deployment cannot hold.
            "front": {"models": [one, {**second, "engine_num_cpus": one["engine_num_cpus"] / 2}],
                      "router_num_cpus": 0.25}}
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
        res = {"model": "tiny (--quick)" if args.quick else args.model, "threads": args.threads, "serve_env": SERVE_ENV,
               "load_average_start": os.getloadavg()}
        res["rounds"] = []
        for i in range(1 if args.quick else args.rounds):
            print(f"round {i + 1}", flush=True)
            res["rounds"].append({path: serve_and_measure(path, app, loads) for path, app in apps.items()})
        res["load_average_end"] = os.getloadavg()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print(f"\n{res['threads']} torch threads; model {res['model']}")
    columns, rows = table(res)
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_multi_model", columns, rows, raw=res, note=args.note,
                     title=f"One model inside a multi-model app against served alone: {res['model']}")


if __name__ == "__main__":
    main()
