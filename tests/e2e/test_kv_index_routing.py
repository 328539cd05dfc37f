"""The cluster's KV index on real Ray Serve behind HAProxy, two engine replicas (`kv_cache_index`):
the engines publish their KV events to the app's `KVIndex` deployment (counted on Ray's metrics
endpoint), and the prefix router goes by what the index says they hold. A prompt computed on one replica by a request sent to it
directly (the router never routed it, so its own record knows nothing of it) draws the requests
that share its prefix to that replica; a replica killed is forgotten by the index."""

from __future__ import annotations

from typing import Any

import pytest
import ray
import requests

from tests.support.local_serve import local_service
from tests.support.serve_fixtures import engine_replica_ids, engine_replica_ports, metric_sum, router_picks, scrape, \
    wait_until, write_tiny_model

pytestmark = pytest.mark.slow

HTTP_PORT, METRICS_PORT = 18600, 18601
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
SYSTEM = ("You are the helpful assistant of a bakery. Answer questions about bread, opening hours and "
          "prices in one short sentence, politely, and never invent a product we do not sell. ")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    args = {"model": str(model), "num_replicas": 2, "max_num_seqs": 8, "block_size": 16, "engine_num_cpus": 0.5,
            "router_num_cpus": 0.25, "torch_threads": 1, "kv_cache_index": True}
    with local_service(args, HTTP_PORT, num_cpus=2, metrics_port=METRICS_PORT) as base:
        from ray import serve

        router = serve.get_deployment_handle("PrefixRoute", app_name="qkv")
        wait_until(lambda: requests.post(f"{base}/tokenize", json={"prompt": "probe"}, timeout=10).ok
                   and router.routed_requests.remote().result(timeout_s=10) > 0, 60, "HAProxy to use the router")
        wait_until(lambda: len(engine_replica_ports()) == 2, 60, "HAProxy to list both engine replicas")
        yield base


def index_held() -> dict[str, int]:
    """Replica unique id -> the blocks the KV index says it holds."""
    from ray import serve

    return serve.get_deployment_handle("KVIndex", app_name="qkv").stats.remote().result(timeout_s=30)["held"]


def live_ports() -> list[int] | None:
    """The ports of both engine replicas as HAProxy lists them, once both answer (after a replica
    was replaced, HAProxy's list names the new one a moment later)."""
    ports = engine_replica_ports()

    def answers(port: int) -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).ok
        except requests.RequestException:
            return False

    return ports if len(ports) == 2 and all(map(answers, ports)) else None


def computed_behind_the_routers_back(prompt: str) -> tuple[dict[str, Any], str, dict[str, int]]:
    """Send `prompt` straight to one replica's own port (the router never sees it) and wait until
    the index says which replica holds more blocks than before: (the answer, that replica, what
    the index holds now). Counted from what was held before, so the module's other tests may run
    first."""
    wait_until(lambda: set(index_held()) == engine_replica_ids(), 60, "both replicas to publish (heartbeats)")
    before = index_held()
    port = wait_until(live_ports, 60, "HAProxy to list both live replicas")[0]
    answer = complete(f"http://127.0.0.1:{port}", prompt)
    held = wait_until(lambda: (h := index_held()) and any(n > before.get(r, 0) for r, n in h.items()) and h, 30,
                      "the index to learn the blocks")
    [holder] = [r for r, n in held.items() if n > before.get(r, 0)]
    return answer, holder, held


def complete(base: str, prompt: str) -> dict[str, Any]:
    r = requests.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0,
                                                      "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_a_prefix_computed_behind_the_routers_back_draws_its_requests(url: str) -> None:
    first, holder, held = computed_behind_the_routers_back(SYSTEM + "Question 0: when do you open?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Ray's metrics endpoint: the events the holder sent, the index's size.
    wait_until(lambda: metric_sum(scrape(METRICS_URL), "ray_qkv_kv_events_total", replica=holder) > 0
               and metric_sum(scrape(METRICS_URL), "ray_qkv_kv_index_blocks") >= held[holder], 60,
               "the KV events and the index's size on Ray's metrics endpoint")
    before = len(router_picks())
    usages = [complete(url, f"{SYSTEM}Question {i}: when do you open?")["usage"] for i in range(1, 5)]
    picks = router_picks()[before:]
    assert len(picks) == 4
    for pick in picks:  # the index's holder, for the prefix: though the router had never sent it there
        assert pick["why"] == "prefix" and pick["replica_id"].endswith(holder), pick
    # The routers time their decisions and their questions to the index (Ray's metrics endpoint).
    wait_until(lambda: metric_sum(scrape(METRICS_URL), "ray_qkv_router_index_lookup_seconds_count") >= 4
               and metric_sum(scrape(METRICS_URL), "ray_qkv_router_pick_seconds_count") >= 4, 60,
               "the routers' decision and lookup times on Ray's metrics endpoint")
    # HAProxy follows the picks unless it gave up waiting on the router (it may under load):
    # where it did not, the requests ran where the blocks were.
    assert any(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages)


def test_a_killed_replica_is_forgotten_by_the_index(url: str) -> None:
    _, holder, held = computed_behind_the_routers_back("A preamble of this test's own, which no other test sends: "
                                                        "it fills several blocks of sixteen tokens.")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::qkv#EngineDeployment#{holder}", namespace="serve"), no_restart=True)
    # Its heartbeats stop: gone from the index within its ttl (10 s), well before any replacement
    # could hold the same blocks.
    wait_until(lambda: holder not in index_held(), 30, "the index to forget the killed replica", every_s=0.5)
    wait_until(lambda: len(engine_replica_ids()) == 2 and holder not in engine_replica_ids(), 120,
               "Serve to replace the replica")
    wait_until(lambda: set(index_held()) == engine_replica_ids(), 60, "the replacement to publish")
    replacement = engine_replica_ids() - set(held)
    assert len(replacement) == 1 and index_held()[replacement.pop()] == 0  # it starts empty
