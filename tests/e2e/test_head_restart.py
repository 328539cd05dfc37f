"""The head restarted under load, with GCS fault tolerance on a real Redis (Debian's
`redis-server`, started by the test), on a Ray cluster of three nodes on loopback
(tests/support/ray_nodes.py): the head (Serve's controller, HAProxy, the KV index) and two workers
with one engine replica each.

Closed-loop streaming clients send to each engine replica's own HTTP edge, which is what HAProxy
forwards to: on one machine the per-node proxies of a real deployment (`proxy_location:
EveryNode`) would all want the same port, so the clients stand in for the workers' own proxies.
Every process of the head is SIGKILLed at once, and the head is started again with the same
command a few seconds later.

What must hold: no request to the running replicas fails or hangs through the loss and the
restart; the replicas are the same processes afterwards (the GCS took its state back from Redis
and the workers reconnected to it, so nothing was restarted); and the restarted head serves
again through HAProxy.
"""

from __future__ import annotations

import shutil
import time
from contextlib import ExitStack
from typing import Any

import pytest
import requests

from tests.support.ray_nodes import RayNodes, replica_urls, start_serving_cluster
from tests.support.redis_server import RedisServer
from tests.support.requirements import required
from tests.support.serve_fixtures import wait_until, write_tiny_model
from tests.support.stream_load import StreamLoad

pytestmark = pytest.mark.slow

BASE_PORT, HTTP_PORT, REDIS_PORT = 19500, 19006, 19007  # the cluster's ports: 19500-19659
CLIENTS, MAX_TOKENS = 2, 32  # per replica
HEAD_DOWN_S = 5.0  # how long the head stays down before it is started again


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    required(shutil.which("redis-server") is not None,
             "redis-server not installed (apt-get install redis-server; .ci/run does it)")
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    with RedisServer(REDIS_PORT, tmp_path_factory.mktemp("redis")) as redis:
        cluster = start_serving_cluster(model, BASE_PORT, HTTP_PORT, redis_address=redis.address)
        try:
            yield cluster
        finally:
            cluster.stop()


def replica_pids(nodes: RayNodes) -> dict[str, int]:
    return {r["replica_id"]: r["pid"] for r in nodes.replicas("qkv", "EngineDeployment") if r.get("state") == "RUNNING"}


def haproxy_serves(url: str) -> bool:
    try:
        return requests.post(f"{url}/v1/completions", json={"prompt": "probe", "max_tokens": 2}, timeout=30).ok
    except requests.RequestException:
        return False


def test_requests_to_running_replicas_are_served_through_a_head_restart(nodes: RayNodes) -> None:
    urls = replica_urls(nodes)
    assert set(urls) == {"a", "b"}, urls
    before = replica_pids(nodes)
    assert len(before) == 2, before
    with ExitStack() as stack:
        loads = [stack.enter_context(StreamLoad(url, CLIENTS, MAX_TOKENS)) for url in urls.values()]
        wait_until(lambda: all(load.served_since(0) >= CLIENTS for load in loads), 120, "the load to run")
        killed, killed_at = nodes.kill("head")
        assert killed > 0
        time.sleep(HEAD_DOWN_S)
        during = time.time()
        assert all(load.served_since(killed_at) > 0 for load in loads), "the replicas stopped serving with the head down"
        nodes.start("head")
        back = time.time()
        wait_until(lambda: haproxy_serves(f"http://127.0.0.1:{HTTP_PORT}"), 180, "the restarted head's HAProxy to serve")
        wait_until(lambda: all(load.served_since(back) >= CLIENTS for load in loads), 120, "the load to go on")
    outcomes = [o for load in loads for o in load.outcomes]
    assert not [o for o in outcomes if o.hung], "a request hung"
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {[o.error for o in failed[:5]]}"
    assert [o for o in outcomes if killed_at <= o.sent <= during], "no request was sent while the head was down"
    # The same replica processes: nothing was restarted, the new controller took them over.
    wait_until(lambda: replica_pids(nodes) == before, 120, f"Serve to list the same replicas as before: {before}")
