"""A worker node lost under load, on a Ray cluster of three nodes on loopback (tests/support/ray_nodes.py):
the head (Serve's controller, HAProxy, the KV index) and two workers, each holding one engine
replica (a custom resource places them). Closed-loop streaming clients run through HAProxy while
every process of one worker (its raylet, agents and replica workers) is SIGKILLed at once, as a
machine that loses power.

What must hold: no request hangs; every request sent after the loss is served by the other node
(none fails); a stream in flight on the lost node ends with a closed connection or an error, not
a hang; the KV index forgets the lost replica; and when the node comes back (`ray start` again),
Serve places the missing replica on it and both nodes serve again.

The figures (how soon streams end, the index forgets, the replica is back) are measured by
loadtests/benchmarks/bench_node_loss.py; the bounds here are hang bounds.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests

from tests.support.ray_nodes import RayNodes, engines_running, index_replicas, start_serving_cluster
from tests.support.serve_fixtures import metric_sum, scrape, wait_until, write_tiny_model
from tests.support.stream_load import StreamLoad

pytestmark = pytest.mark.slow

BASE_PORT, HTTP_PORT = 18720, 18710  # the cluster's ports: 18720-18879 (tests/support/ray_nodes.py)
CLIENTS, MAX_TOKENS = 4, 48


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cluster = start_serving_cluster(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny"), BASE_PORT, HTTP_PORT)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_worker_lost_under_load_fails_no_request_sent_after_it_and_comes_back(nodes: RayNodes) -> None:
    url = f"http://127.0.0.1:{HTTP_PORT}"
    wait_until(lambda: index_replicas(nodes) == 2, 60, "the KV index to hear from both engine replicas")
    with StreamLoad(url, CLIENTS, MAX_TOKENS) as load:
        wait_until(lambda: load.served_since(0) >= 2 * CLIENTS, 120, "the load to run")
        killed, killed_at = nodes.kill("a")
        assert killed > 0
        # The index forgets the lost replica (it stops hearing its heartbeats); the load goes on.
        wait_until(lambda: index_replicas(nodes) == 1, 60, "the KV index to forget the lost replica")
        after = time.time()
        wait_until(lambda: load.served_since(after) >= 2 * CLIENTS, 120, "the load to go on after the loss")
    outcomes = load.outcomes
    assert not [o for o in outcomes if o.hung], "a request hung"
    in_flight = [o for o in outcomes if o.sent < killed_at <= o.ended]
    sent_after = [o for o in outcomes if o.sent >= killed_at]
    failed_after = [o for o in sent_after if not o.ok]
    assert not failed_after, f"{len(failed_after)} of {len(sent_after)} requests sent after the loss failed: " \
                             f"{[o.error for o in failed_after[:5]]}"
    # What was running on the lost node ended with it (the test's bound is a hang bound: the
    # benchmark measures how soon); nothing served before the loss was lost.
    cut = [o for o in in_flight if not o.ok]
    assert all(o.ended - killed_at < 30 for o in cut), [(o.ended - killed_at, o.error) for o in cut]
    assert all(o.ok for o in outcomes if o.ended < killed_at)

    # The node comes back: Serve places the missing replica there, and both serve again.
    nodes.start("a")
    wait_until(lambda: engines_running(nodes) == {"a": 1, "b": 1}, 180, "the replica back on the returned node",
               every_s=1)
    wait_until(lambda: index_replicas(nodes) == 2, 60, "the KV index to hear from the new replica")
    # Prompts no replica holds: the prefix router places them by load, so the returned replica
    # gets its share (the clients' usual prompts stay where their first block is cached: node b).
    returned = f"http://127.0.0.1:{nodes.nodes['a'].metrics_port}/metrics"
    with StreamLoad(url, CLIENTS, MAX_TOKENS, fresh_prefixes=True) as load:
        wait_until(lambda: served(returned) > 0, 120, "the returned node's replica to serve requests")
    assert all(o.ok for o in load.outcomes), [o.error for o in load.outcomes if not o.ok][:5]


def served(metrics_url: str) -> float:
    """Requests served by the node's replicas (0 while its metrics endpoint does not answer yet)."""
    try:
        return metric_sum(scrape(metrics_url), "ray_qkv_request_success_total")
    except requests.RequestException:
        return 0.0
