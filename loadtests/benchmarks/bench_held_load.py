"""Load held by one engine replica under HAProxy: 1,000 concurrent streams, then a soak with
clients that disconnect at random, in one run on a local Ray Serve (127.0.0.1 only).

- streams: `--streams` streaming `/v1/completions` clients (asyncio + httpx, one connection
  each) sent at once to one replica whose admission queues them (max_queued_requests >= the
  streams). Every request must end with 200 and a whole stream or a clean 429/503 in the API's
  error shape; never another status, a cut stream or an error event. Sampled every 0.2 s: the
  replica process's RSS and open file descriptors, and the engine's running and waiting
  requests; again once the service is idle (they must come back to their baseline);
- soak: `--soak-clients` clients for `--soak-s` seconds, each request streamed; with
  probability `--disconnect` a client closes its connection at a random point (before the
  first byte or after a random number of chunks) and goes on with a new one. At the end every
  request has been aborted or finished: the engine's KV-cache usage, running and waiting
  counts are back to 0 (no block leaked), and so are the replica's descriptors.

    .venv/bin/python loadtests/benchmarks/bench_held_load.py --out docs/results/bench_held_load.json
    .venv/bin/python loadtests/benchmarks/bench_held_load.py --soak-s 600    # the 10-minute soak
tests/e2e/test_held_load.py runs both parts, shorter, on a tiny model.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.launch import apply_serving_env  # noqa: E402

apply_serving_env()  # before Ray Serve is imported: HAProxy in front of the replica

from loadtests.lib.held_load import HTTP_PORT, held_streams, service_args, soak  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402


def table(res: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    columns = ["part", "requests", "statuses", "complete", "unclean", "RSS MiB before / peak / after",
               "fds before / peak / after", "engine after"]
    rows = []
    for name, r in (("streams", res["streams"]), ("soak", res["soak"])):
        n = r["streams"] if name == "streams" else r["requests"]
        complete = f"{r['complete']} of {r['statuses'].get('200', 0) if name == 'streams' else r['uncut']}"
        if name == "soak":
            complete += f" (+{r['cut']} cut)"
        e = r["engine_after"]
        rows.append([f"{name} ({r['streams']} at once)" if name == "streams" else
                     f"soak ({r['clients']} clients, {r['seconds']:.0f} s, {r['disconnect']:.0%} cut)",
                     str(n), ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())), complete,
                     str(r["unclean"]), f"{mib(r['before']['rss_bytes'])} / {mib(r['peak']['rss_bytes'])} / "
                     f"{mib(r['after']['rss_bytes'])}",
                     f"{r['before']['open_fds']} / {r['peak']['open_fds']} / {r['after']['open_fds']}",
                     f"running {e['num_running']}, waiting {e['num_waiting']}, KV {e['kv_cache_usage']:.0%}"])
    return columns, rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.local_serve import local_service, write_tiny_checkpoint
    from ray import serve

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "held", max_position=1024, d_model=args.d_model, n_heads=4,
                                     n_layers=2, d_ff=4 * args.d_model)
        with local_service(service_args(str(ckpt), args.streams), HTTP_PORT, num_cpus=2) as url:
            handle = serve.get_deployment_handle("EngineDeployment", app_name="qkv")
            stats = lambda: handle.engine_stats.remote().result()  # noqa: E731
            res = {"streams": held_streams(url, args.streams, args.max_tokens, stats)}
            print(f"streams: {res['streams']['statuses']} in {res['streams']['seconds']:.1f} s", flush=True)
            res["soak"] = soak(url, args.soak_s, args.soak_clients, args.max_tokens, args.disconnect, stats)
            print(f"soak: {res['soak']['requests']} requests, {res['soak']['statuses']}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens a request asks for (the soak: 1 to this)")
    ap.add_argument("--soak-s", type=float, default=120.0)
    ap.add_argument("--soak-clients", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.3, help="the share of soak requests cut by their client")
    ap.add_argument("--d-model", type=int, default=64, help="the random model's width")
    add_result_args(ap, "results/bench_held_load.json")
    args = ap.parse_args()
    res = run(args)
    columns, rows = table(res)
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_held_load", columns, rows, raw=res, note=args.note,
                     title="Load held by one replica under HAProxy")


if __name__ == "__main__":
    main()
