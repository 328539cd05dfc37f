"""A worker node lost under load and brought back, on a Ray cluster of three nodes on 127.0.0.1
(tests/support/ray_nodes.py: the head with Serve's controller, HAProxy and the KV index; workers a
and b with one engine replica each), measured over `--rounds` losses (the workers in turn):

1. closed-loop streaming clients (`--clients`, `--max-tokens` tokens each) run through HAProxy;
2. every process of one worker is SIGKILLed at once (its raylet, agents and replica);
3. recorded: the streams in flight on the lost node (cut) and how long after the kill the last of
   them ended, the requests sent after the kill (after every process was signalled: a request sent
   while they are being found may still reach the node) and how many failed, whether any request reached
   the clients' hang bound, and how long the KV index took to forget the lost replica (its gauge
   on the head's metrics endpoint, polled every 0.25 s);
4. the node is started again (`ray start`, the same command): how long from that command's return
   until Serve runs the replica on it, and until the KV index hears from it.

Targets: 0 failed requests sent after the loss, 0 hangs, cut streams ended within 5 s, the replica
back within 60 s of the node's return.

    .venv/bin/python loadtests/benchmarks/bench_node_loss.py --out docs/results/bench_node_loss.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.polling import first_time  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

BASE_PORT, HTTP_PORT = 19100, 19090  # the cluster's ports: 19100-19259 (tests/support/ray_nodes.py)


def one_loss(nodes: Any, victim: str, args: argparse.Namespace) -> dict[str, Any]:
    from tests.support.ray_nodes import WORKERS, engines_running, index_replicas
    from tests.support.stream_load import StreamLoad

    url = f"http://127.0.0.1:{HTTP_PORT}"
    if first_time(lambda: index_replicas(nodes) == len(WORKERS), 60) is None:
        raise RuntimeError("the KV index never listed both replicas")
    with StreamLoad(url, args.clients, args.max_tokens) as load:
        if first_time(lambda: load.served_since(0) >= 2 * args.clients, 120) is None:
            raise RuntimeError("the load never ran")
        killed, killed_at = nodes.kill(victim)
        forget_s = first_time(lambda: index_replicas(nodes) == len(WORKERS) - 1, 60)
        after = time.time()
        first_time(lambda: load.served_since(after) >= args.after_requests, 180)
    outcomes = load.outcomes
    cut = [o for o in outcomes if o.sent < killed_at <= o.ended and not o.ok]
    sent_after = [o for o in outcomes if o.sent >= killed_at]
    returned_at = time.time()
    nodes.start(victim)
    started_s = time.time() - returned_at
    restored_s = first_time(lambda: engines_running(nodes) == dict.fromkeys(WORKERS, 1), 300, every_s=0.5)
    heard_s = first_time(lambda: index_replicas(nodes) == len(WORKERS), 120)
    return {
        "victim": victim, "processes_killed": killed,
        "in_flight_at_kill": sum(o.sent < killed_at <= o.ended for o in outcomes),
        "cut": len(cut), "cut_errors": sorted({(o.error or "")[:80] for o in cut}),
        "cut_ended_max_s": round(max((o.ended - killed_at for o in cut), default=0.0), 3),
        "sent_after": len(sent_after), "failed_after": sum(not o.ok for o in sent_after),
        "failed_after_errors": sorted({(o.error or "")[:80] for o in sent_after if not o.ok}),
        # each failure's send time after the kill and how long it took, in seconds
        "failed_after_when": [[round(o.sent - killed_at, 2), round(o.ended - o.sent, 2)] for o in sent_after if not o.ok],
        "hung": sum(o.hung for o in outcomes),
        "index_forgot_s": None if forget_s is None else round(forget_s, 2),
        "ray_start_s": round(started_s, 2),
        "replica_back_s": None if restored_s is None else round(restored_s, 2),
        "index_heard_s": None if heard_s is None or restored_s is None else round(restored_s + heard_s, 2),
    }


def table(res: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["round", "node lost", "streams in flight", "cut", "last cut ended (s after kill)",
               "sent after the loss", "failed", "hung", "index forgot (s)", "replica back (s after node's return)"]
    rows = [[i + 1, r["victim"], r["in_flight_at_kill"], r["cut"], r["cut_ended_max_s"], r["sent_after"],
             r["failed_after"], r["hung"], r["index_forgot_s"], r["replica_back_s"]] for i, r in enumerate(res["rounds"])]
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="node losses (workers a and b in turn)")
    ap.add_argument("--clients", type=int, default=4, help="closed-loop streaming clients")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--after-requests", type=int, default=24, help="requests served after the loss before the load stops")
    add_result_args(ap, None)
    args = ap.parse_args()
    from tests.support.ray_nodes import WORKERS, start_serving_cluster
    from tests.support.serve_fixtures import write_tiny_model

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        nodes = start_serving_cluster(write_tiny_model(Path(tmp) / "tiny"), BASE_PORT, HTTP_PORT)
        try:
            for i in range(args.rounds):
                rounds.append(one_loss(nodes, WORKERS[i % len(WORKERS)], args))
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            nodes.stop()
    res = {"rounds": rounds, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "note", "allow_dirty")}}
    columns, rows = table(res)
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_node_loss", columns, rows, raw=res, note=args.note,
                     title="A worker node lost under load, and back")


if __name__ == "__main__":
    main()
