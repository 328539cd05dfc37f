"""Fairness under overload: one tenant sends 10x its share while two others go on as usual, on a
local Ray Serve (one engine replica, 127.0.0.1 only), measured twice in one run:

- first come: one shared key (`api_key`), today's behaviour without tenants: every request
  queues behind the ones before it;
- tenants: a keys file (`api_keys_file`) giving each tenant `max_concurrency` = its share of the
  engine's slots; the flood's excess gets 429 with Retry-After, which its clients honour (as the
  official SDKs do), and the engine admits waiting requests tenant by tenant.

Each mode runs the quiet tenants alone first (their unloaded TTFT), then with the flood, and
with tenants once more beside the noisy tenant at its share only (no 429s: what its share of the
batch and the CPU alone costs the others). The
quiet tenants are closed-loop streaming clients (a short think time between requests); the noisy
tenant runs 10x its share of concurrent clients. Reported: the quiet tenants' TTFT p50/p99 and
success rate in each phase (and the flooded p99 of the requests sent after the flood's first
second, when its clients have all sent at once), the loaded/unloaded p99 ratio (issue 40's target: at most 1.5 with
tenants, with 100% success), and the ledger's cost: the mean time of one `acquire` plus one
`report` call to the Quotas deployment from this process, and the unloaded TTFT with tenants
against without.

    .venv/bin/python loadtests/benchmarks/bench_tenant_fairness.py --out docs/results/bench_tenant_fairness.json
    .venv/bin/python loadtests/benchmarks/bench_tenant_fairness.py --quick      # ~1.5 min: tests/e2e/test_tenant_fairness.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.launch import apply_serving_env  # noqa: E402

apply_serving_env()  # before Ray Serve is imported: HAProxy in front of the replica

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.think_clients import clients, summary  # noqa: E402
from service.tenancy.keys import Limits, hash_key  # noqa: E402

HTTP_PORT = 18430
QUIET = ("quiet-1", "quiet-2")
NOISY = "noisy"
SHARE = 4  # each tenant's max_concurrency: its share of the engine's slots
MAX_NUM_SEQS = 16


def keys_file(directory: Path) -> Path:
    tenants = {name: {"keys": [hash_key(f"key-{name}")], "max_concurrency": SHARE} for name in (*QUIET, NOISY)}
    path = directory / "keys.json"
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def service_args(model: str, keys: Path | None) -> dict[str, Any]:
    auth = {"api_keys_file": str(keys)} if keys else {"api_key": "key-shared"}
    return {"model": model, "served_model_name": "bench", "max_num_seqs": MAX_NUM_SEQS, "engine_num_cpus": 1,
            "torch_threads": 1, "max_queued_requests": 512, **auth}


def flood(url: str, key: str, seconds: float, max_tokens: int, n: int, ready: Any, results: Any) -> None:
    """The noisy tenant, in its own process: `n` clients sending back to back."""
    work = [(key, max_tokens, 0.0, 1000 + j) for j in range(n)]
    results.put([r for out in asyncio.run(clients(url, work, seconds, ready)) for r in out])


def phase(url: str, keys: dict[str, str], seconds: float, flood_clients: int, args: argparse.Namespace
          ) -> dict[str, list[dict[str, Any]]]:
    """The quiet tenants' clients in this process for `seconds`, beside `flood_clients` of the noisy
    tenant (in a child process, so that its clients do not delay the quiet ones' reading)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in (*QUIET, NOISY)}
    child = None
    if flood_clients:
        ctx = multiprocessing.get_context("spawn")
        ready, queue = ctx.Event(), ctx.Queue()
        child = ctx.Process(target=flood, args=(url, keys[NOISY], seconds, args.noisy_max_tokens, flood_clients,
                                                ready, queue))
        child.start()
        if not ready.wait(120):
            raise RuntimeError("the flood's process did not start")
    work = [(keys[name], args.max_tokens, args.think_s, 100 * i + j)
            for i, name in enumerate(QUIET) for j in range(args.quiet_clients)]
    outs = asyncio.run(clients(url, work, seconds))
    for (i, name) in enumerate(QUIET):
        for j in range(args.quiet_clients):
            results[name].extend(outs[i * args.quiet_clients + j])
    if child is not None:
        results[NOISY] = queue.get(timeout=seconds + 300)
        child.join(60)
    return results


def ledger_cost_ms(calls: int) -> float:
    """Mean time of one acquire and one report to the Quotas deployment, from this process."""
    from ray import serve

    handle = serve.get_deployment_handle("Quotas", app_name="qkv")
    limits = Limits(max_concurrency=10 ** 6)
    handle.acquire.remote("bench", limits, 1, "bench").result()  # warm
    t0 = time.perf_counter()
    for _ in range(calls):
        lease = handle.acquire.remote("bench", limits, 1, "bench").result().lease
        handle.report.remote("bench", {"bench": 1}, [lease]).result()
    return (time.perf_counter() - t0) / calls * 1e3


def run_mode(model: str, keys_path: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.local_serve import local_service

    keys = ({name: f"key-{name}" for name in (*QUIET, NOISY)} if keys_path
            else dict.fromkeys((*QUIET, NOISY), "key-shared"))
    with local_service(service_args(model, keys_path), HTTP_PORT, num_cpus=2) as url:
        phase(url, keys, min(3.0, args.seconds), 0, args)  # warm the path
        unloaded = phase(url, keys, args.seconds, 0, args)
        loaded = phase(url, keys, args.seconds, 10 * SHARE, args)
        # The noisy tenant at its share, no more: what its share alone costs the others.
        at_share = phase(url, keys, args.seconds, SHARE, args) if keys_path else None
        cost = ledger_cost_ms(args.ledger_calls) if keys_path else None
    quiet = lambda res: [r for name in QUIET for r in res[name]]  # noqa: E731
    # The flood's first second: its clients all send at once, beside the quiet tenants' first requests.
    flood_start = min((r["sent"] for r in loaded[NOISY] if "sent" in r), default=0.0)
    settled = [r for r in quiet(loaded) if r.get("sent", 0.0) >= flood_start + 1.0]
    return {"unloaded": summary(quiet(unloaded)), "loaded": summary(quiet(loaded)), "loaded_settled": summary(settled),
            "noisy": summary(loaded[NOISY]), "at_share": summary(quiet(at_share)) if at_share else None,
            "ledger_ms": cost}


def table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["mode", "quiet TTFT p50 unloaded (ms)", "quiet TTFT p99 unloaded (ms)", "quiet TTFT p50 flooded (ms)",
               "quiet TTFT p99 flooded (ms)", "p99 flooded / unloaded",
               "quiet TTFT p99 flooded, after the flood's first second (ms)", "quiet success flooded",
               "noisy requests: statuses", "quiet TTFT p99, noisy at its share (ms)",
               "ledger round trip (ms)", "target"]
    rows = []
    for mode, label in (("first_come", "first come (one key)"), ("tenants", "tenants (keys file)")):
        m = res[mode]
        u, f = m["unloaded"], m["loaded"]
        ratio = f["ttft_p99_ms"] / u["ttft_p99_ms"] if u["ttft_p99_ms"] and f["ttft_p99_ms"] else None
        target = ("p99 ratio <= 1.5, success 100%: " +
                  ("reached" if ratio is not None and ratio <= 1.5 and f["success"] == 1.0 else "not reached")
                  if mode == "tenants" else "–")
        rows.append([label, u["ttft_p50_ms"], u["ttft_p99_ms"], f["ttft_p50_ms"], f["ttft_p99_ms"], ratio,
                     m["loaded_settled"]["ttft_p99_ms"],
                     f"{100 * f['success']:.1f}%", " ".join(f"{k}: {v}" for k, v in sorted(m["noisy"]["statuses"].items())),
                     m["at_share"]["ttft_p99_ms"] if m["at_share"] else None, m["ledger_ms"], target])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model and short phases (the test)")
    ap.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    ap.add_argument("--quiet-clients", type=int, default=2, help="closed-loop clients of each quiet tenant")
    ap.add_argument("--think-s", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=16, help="the quiet tenants' requests")
    ap.add_argument("--noisy-max-tokens", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=256, help="the random model's width (--quick: 64)")
    ap.add_argument("--ledger-calls", type=int, default=200)
    add_result_args(ap, None)
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.d_model, args.ledger_calls = 4.0, 64, 20
    from tests.support.local_serve import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "fair", max_position=512, d_model=args.d_model, n_heads=4,
                                          n_layers=4, d_ff=4 * args.d_model))
        res = {"first_come": run_mode(model, None, args), "tenants": run_mode(model, keys_file(Path(tmp)), args)}
    res["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}
    columns, rows = table(res)
    print(json.dumps(res, indent=1))
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_tenant_fairness", columns, rows, raw=res, note=args.note,
                     title="Fairness under overload: one tenant at 10x its share")


if __name__ == "__main__":
    main()
