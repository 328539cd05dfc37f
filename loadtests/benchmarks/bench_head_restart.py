"""The head restarted under load, with GCS fault tolerance on a Redis server (Debian's
`redis-server`, started here), on a Ray cluster of three nodes on 127.0.0.1
(tests/support/ray_nodes.py: the head with Serve's controller, HAProxy and the KV index; workers
a and b with one engine replica each), measured over `--rounds` restarts:

1. closed-loop streaming clients (`--clients` per replica, `--max-tokens` tokens each) send to
   each engine replica's own HTTP edge (what a worker's own proxy forwards to: on one machine the
   per-node proxies would all want one port);
2. every process of the head is SIGKILLed at once, and `ray start --head` runs again with the same
   command after `--down-s` seconds;
3. recorded: the requests sent while the head was down and after, how many failed or hung, how
   long `ray start` took, how long from its return until the new head's HAProxy served a
   completion, and whether the replicas are the same processes afterwards.

Target: 0 failed requests to the running replicas.

    .venv/bin/python loadtests/benchmarks/bench_head_restart.py --out docs/results/bench_head_restart.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.polling import first_time  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

BASE_PORT, HTTP_PORT, REDIS_PORT = 19100, 19090, 19091  # the cluster's ports: 19100-19259


def haproxy_serves() -> bool:
    try:
        return requests.post(f"http://127.0.0.1:{HTTP_PORT}/v1/completions", json={"prompt": "probe", "max_tokens": 2},
                             timeout=30).ok
    except requests.RequestException:
        return False


def replica_pids(nodes: Any) -> dict[str, int]:
    return {r["replica_id"]: r["pid"] for r in nodes.replicas("qkv", "EngineDeployment") if r.get("state") == "RUNNING"}


def one_restart(nodes: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.ray_nodes import replica_urls
    from tests.support.stream_load import StreamLoad

    urls = replica_urls(nodes)
    before = replica_pids(nodes)
    with ExitStack() as stack:
        loads = [stack.enter_context(StreamLoad(url, args.clients, args.max_tokens)) for url in urls.values()]
        if first_time(lambda: all(load.served_since(0) >= args.clients for load in loads), 120) is None:
            raise RuntimeError("the load never ran")
        killed, killed_at = nodes.kill("head")
        time.sleep(args.down_s)
        t0 = time.time()
        nodes.start("head")
        back = time.time()
        serves_s = first_time(haproxy_serves, 300, every_s=0.5)
        first_time(lambda: all(load.served_since(back) >= args.clients for load in loads), 120)
    outcomes = [o for load in loads for o in load.outcomes]
    same_s = first_time(lambda: replica_pids(nodes) == before, 120, every_s=0.5)
    down = [o for o in outcomes if killed_at <= o.sent < back]
    return {
        "processes_killed": killed, "requests": len(outcomes),
        "sent_while_down": len(down), "served_while_down": sum(o.ok for o in down),
        "failed": sum(not o.ok for o in outcomes), "hung": sum(o.hung for o in outcomes),
        "failed_errors": sorted({(o.error or "")[:80] for o in outcomes if not o.ok}),
        "ray_start_s": round(back - t0, 2),
        "haproxy_serves_s": None if serves_s is None else round(serves_s, 2),
        "same_replicas": same_s is not None,
    }


def table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["round", "requests", "sent while the head was down", "failed", "hung", "ray start (s)",
               "HAProxy serves again (s after ray start)", "same replica processes"]
    rows = [[i + 1, r["requests"], r["sent_while_down"], r["failed"], r["hung"], r["ray_start_s"],
             r["haproxy_serves_s"], "yes" if r["same_replicas"] else "no"] for i, r in enumerate(res["rounds"])]
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="head restarts")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop streaming clients per replica")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--down-s", type=float, default=5.0, help="how long the head stays down")
    add_result_args(ap, None)
    args = ap.parse_args()
    from tests.support.ray_nodes import start_serving_cluster
    from tests.support.redis_server import RedisServer
    from tests.support.serve_fixtures import write_tiny_model

    rounds = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(REDIS_PORT, Path(tmp)) as redis:
        nodes = start_serving_cluster(write_tiny_model(Path(tmp) / "tiny"), BASE_PORT, HTTP_PORT,
                                      redis_address=redis.address)
        try:
            for _ in range(args.rounds):
                rounds.append(one_restart(nodes, args))
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            nodes.stop()
    res = {"rounds": rounds, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}}
    columns, rows = table(res)
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_head_restart", columns, rows, raw=res, note=args.note,
                     title="The head restarted under load (GCS fault tolerance on Redis)")


if __name__ == "__main__":
    main()
