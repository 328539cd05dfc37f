"""A batch beside interactive traffic, on a local Ray Serve (one engine replica, 127.0.0.1 only,
priority scheduling, the Batch API over a temporary `batch_dir`), measured in one run, for each
value of the engine's `lowest_priority_max_seqs` given, and with `--ray-data` once more with every
batch handed to a Ray Data job (`batch_offline_min_lines` 1: one engine actor of one CPU beside the
replica, on a local Ray of 3 logical CPUs), a fresh service each:

1. interactive alone: closed-loop streaming clients (a short think time between requests) for
   `--seconds`: their TTFT p50/p99;
2. a batch alone on the idle service: `--lines` completion requests through `POST /v1/batches`,
   timed from the create call until the batch is seen `completed` (polled every 0.1 s): generated
   tokens per second;
3. interactive beside a batch: the same clients for `--seconds` while a batch of `--beside-lines`
   lines runs (it must still be running when the phase ends, or the phase is reported as not
   measured); the batch is cancelled afterwards;
then, once:
4. the offline engine: the same requests as phase 2 through `model.LLM.generate` in this process
   (one torch thread, as the replica has), after the services are stopped;
5. with `--cpu-hog`, the bound the machine sets: on a fresh service with no batch, the clients
   alone and then beside a busy-loop process (one core's worth of work that is not the service's),
   which is what any batch computing on the same two cores costs at least.

Reported, for each setting: interactive TTFT p99 beside the batch / alone (target: <= 1.2) and the
batch's throughput on the idle service / the offline engine's (target: >= 0.9).

    .venv/bin/python loadtests/benchmarks/bench_batch_beside_interactive.py --ray-data --cpu-hog --out docs/results/bench_batch_beside_interactive.json
    .venv/bin/python loadtests/benchmarks/bench_batch_beside_interactive.py --quick   # ~3 min, a tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.launch import apply_serving_env  # noqa: E402

apply_serving_env()  # before Ray Serve is imported: HAProxy in front of the replica

import httpx  # noqa: E402

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.think_clients import clients, summary  # noqa: E402

HTTP_PORT = 18590
MODEL = "bench"
MAX_NUM_SEQS = 16
WORDS = ("red", "blue", "cat", "sat", "on", "the", "mat", "a", "dog", "ran")


def prompts(n: int, seed: int, words: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


RAY_DATA = "ray-data"  # the run whose batches go to a Ray Data job


def service_args(model: str, batch_dir: str, mode: int | str | None = None) -> dict[str, Any]:
    """`mode`: None (no limit), an int (`lowest_priority_max_seqs`) or RAY_DATA."""
    if mode == RAY_DATA:
        extra: dict[str, Any] = {"batch_offline_min_lines": 1, "batch_offline_num_cpus": 1}
    else:
        extra = {} if mode is None else {"lowest_priority_max_seqs": mode}
    return {"model": model, "served_model_name": MODEL, "max_num_seqs": MAX_NUM_SEQS, "engine_num_cpus": 1,
            "torch_threads": 1, "max_queued_requests": 512, "scheduling_policy": "priority",
            "batch_dir": batch_dir, "batch_concurrency": MAX_NUM_SEQS, **extra}


def interactive(url: str, n: int, seconds: float, max_tokens: int, think_s: float) -> list[dict[str, Any]]:
    """`n` closed-loop streaming clients for `seconds`: every result's status and TTFT."""
    work = [(None, max_tokens, think_s, 100 + i) for i in range(n)]
    return [r for out in asyncio.run(clients(url, work, seconds, words=WORDS)) for r in out]


def submit(http: httpx.Client, texts: list[str], max_tokens: int) -> str:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": t, "max_tokens": max_tokens, "temperature": 0.0,
                                  "ignore_eos": True}}) for i, t in enumerate(texts)]
    r = http.post("/v1/files", files={"file": ("in.jsonl", ("\n".join(lines) + "\n").encode())},
                  data={"purpose": "batch"})
    r.raise_for_status()
    r = http.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/completions",
                                       "completion_window": "24h"})
    r.raise_for_status()
    return r.json()["id"]


def batch_state(http: httpx.Client, batch_id: str) -> dict[str, Any]:
    r = http.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    return r.json()


def run_service(model: str, args: argparse.Namespace, mode: int | str | None) -> dict[str, Any]:
    from tests.support.local_serve import local_service

    # The job's actor takes one logical CPU of its own: two cores still run everything.
    cpus = 3 if mode == RAY_DATA else 2
    with tempfile.TemporaryDirectory() as batch_dir, \
            local_service(service_args(model, batch_dir, mode), HTTP_PORT, num_cpus=cpus) as url, \
            httpx.Client(base_url=url, timeout=120) as http:
        interactive(url, args.clients, min(3.0, args.seconds), args.max_tokens, args.think_s)  # warm
        alone = interactive(url, args.clients, args.seconds, args.max_tokens, args.think_s)

        batch_id = submit(http, prompts(args.lines, 7), args.batch_max_tokens)
        t0 = time.perf_counter()
        while (state := batch_state(http, batch_id))["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.1)
        idle_s = time.perf_counter() - t0

        beside_id = submit(http, prompts(args.beside_lines, 11), args.batch_max_tokens)
        while batch_state(http, beside_id)["request_counts"]["completed"] == 0:  # the batch is running
            time.sleep(0.1)
        start_done = batch_state(http, beside_id)["request_counts"]["completed"]
        beside = interactive(url, args.clients, args.seconds, args.max_tokens, args.think_s)
        end = batch_state(http, beside_id)
        http.post(f"/v1/batches/{beside_id}/cancel")
    return {"alone": summary(alone), "beside": summary(beside),
            "idle_batch": {"status": state["status"], "lines": args.lines, "completed": state["request_counts"]["completed"],
                           "seconds": idle_s, "tokens_per_s": state["request_counts"]["completed"] * args.batch_max_tokens / idle_s},
            "beside_batch": {"status_at_end": end["status"],
                             "lines_during_phase": end["request_counts"]["completed"] - start_done,
                             "running_throughout": end["status"] == "in_progress"}}


def run_beside_hog(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The clients alone, then beside a busy loop (no batch): the cost of sharing the cores."""
    import subprocess

    from tests.support.local_serve import local_service

    with tempfile.TemporaryDirectory() as batch_dir, \
            local_service(service_args(model, batch_dir), HTTP_PORT, num_cpus=2) as url:
        interactive(url, args.clients, min(3.0, args.seconds), args.max_tokens, args.think_s)  # warm
        alone = interactive(url, args.clients, args.seconds, args.max_tokens, args.think_s)
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            beside = interactive(url, args.clients, args.seconds, args.max_tokens, args.think_s)
        finally:
            hog.kill()
            hog.wait()
    return {"alone": summary(alone), "beside": summary(beside)}


def run_offline(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from model import LLM, SamplingParams

    torch.set_num_threads(1)  # as the replica (torch_threads 1)
    llm = LLM(model, device="cpu", max_num_seqs=MAX_NUM_SEQS)
    params = SamplingParams(max_tokens=args.batch_max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(MAX_NUM_SEQS, 3), params)  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts(args.lines, 7), params)
    seconds = time.perf_counter() - t0
    return {"lines": len(outs), "seconds": seconds, "tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds}


def label(mode: int | str | None) -> str:
    if mode == RAY_DATA:
        return "Ray Data job"
    return "no limit" if mode is None else f"lowest_priority_max_seqs {mode}"


def table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["measure", "baseline", "with the batch / service", "ratio", "target"]
    rows = []
    for name, run in res["runs"].items():
        a, b = run["alone"], run["beside"]
        ttft_ratio = b["ttft_p99_ms"] / a["ttft_p99_ms"] if a["ttft_p99_ms"] and b["ttft_p99_ms"] else None
        measured = run["beside_batch"]["running_throughout"]
        rate_ratio = run["idle_batch"]["tokens_per_s"] / res["offline"]["tokens_per_s"]
        rows += [[f"{name}: interactive TTFT p50 (ms)", a["ttft_p50_ms"], b["ttft_p50_ms"],
                  b["ttft_p50_ms"] / a["ttft_p50_ms"] if a["ttft_p50_ms"] and b["ttft_p50_ms"] else None, "–"],
                 [f"{name}: interactive TTFT p99 (ms)", a["ttft_p99_ms"], b["ttft_p99_ms"], ttft_ratio,
                  ("<= 1.2: " + ("reached" if ttft_ratio is not None and ttft_ratio <= 1.2 else "not reached"))
                  if measured else "not measured: the batch ended during the phase"],
                 [f"{name}: interactive requests succeeded", f"{a['statuses'].get('200', 0)}/{a['requests']}",
                  f"{b['statuses'].get('200', 0)}/{b['requests']}", None, "all"],
                 [f"{name}: batch lines answered during the phase", None, run["beside_batch"]["lines_during_phase"],
                  None, "> 0"],
                 [f"{name}: batch tokens/s, offline engine vs the idle service", res["offline"]["tokens_per_s"],
                  run["idle_batch"]["tokens_per_s"], rate_ratio,
                  ">= 0.9: " + ("reached" if rate_ratio >= 0.9 else "not reached")]]
    if res.get("cpu_hog"):
        a, b = res["cpu_hog"]["alone"], res["cpu_hog"]["beside"]
        for q in ("p50", "p99"):
            x, y = a[f"ttft_{q}_ms"], b[f"ttft_{q}_ms"]
            rows.append([f"no batch, a busy loop beside: interactive TTFT {q} (ms)", x, y,
                         y / x if x and y else None, "the bound two shared cores set"])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, short phases, small batches")
    ap.add_argument("--seconds", type=float, default=30.0, help="each interactive phase's length")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop interactive clients")
    ap.add_argument("--think-s", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=16, help="the interactive requests'")
    ap.add_argument("--lines", type=int, default=1000, help="the batch timed on the idle service and offline")
    ap.add_argument("--beside-lines", type=int, default=8000,
                    help="the batch beside the interactive phase (large enough to outlast it)")
    ap.add_argument("--batch-max-tokens", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256, help="the random model's width (--quick: 64)")
    ap.add_argument("--lowest-priority-max-seqs", nargs="+", default=["none", "1"],
                    help="the engine's lowest_priority_max_seqs (batch rows in a step beside interactive requests) "
                         "to measure, one service each; none: no limit")
    ap.add_argument("--ray-data", action="store_true",
                    help="also a service that hands every batch to a Ray Data job (batch_offline_min_lines 1)")
    ap.add_argument("--cpu-hog", action="store_true",
                    help="also the clients beside a busy-loop process and no batch (the machine's bound)")
    add_result_args(ap, None)
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.d_model, args.lines, args.beside_lines = 4.0, 64, 64, 400
    from tests.support.local_serve import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "m", max_position=512, d_model=args.d_model, n_heads=4,
                                          n_layers=4, d_ff=4 * args.d_model))
        modes: list[int | str | None] = [None if v == "none" else int(v) for v in args.lowest_priority_max_seqs]
        modes += [RAY_DATA] if args.ray_data else []
        res: dict[str, Any] = {"runs": {label(mode): run_service(model, args, mode) for mode in modes}}
        if args.cpu_hog:
            res["cpu_hog"] = run_beside_hog(model, args)
        res["offline"] = run_offline(model, args)
    res["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}
    columns, rows = table(res)
    print(json.dumps(res, indent=1))
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_batch_beside_interactive", columns, rows, raw=res, note=args.note,
                     title="A batch beside interactive traffic")


if __name__ == "__main__":
    main()
