"""Cross-node prefix fetch (`kv_remote_fetch`) on a Ray cluster of three nodes on loopback
(tests/support/ray_nodes.py): the head (Serve's controller, HAProxy, the KV index) and workers a
and b with one engine replica each.

A prompt computed by the replica on a, then sent to the replica on b (straight to its HTTP edge,
past the router that would send it to a), is answered from blocks b fetched from a across the
nodes, with the tokens a computed. Then a prompt a holds is sent to b just after node a is killed:
no block can come, and b computes the prompt itself, answers it with a's tokens, and counts it
once, as a fallback or a skip.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import requests

from tests.support.ray_nodes import RayNodes, replica_urls, start_serving_cluster
from tests.support.serve_fixtures import metric_sum, scrape, wait_until, write_tiny_model

pytestmark = pytest.mark.slow

BASE_PORT, HTTP_PORT = 19260, 19005  # the cluster's ports: 19260-19419 (tests/support/ray_nodes.py)
FETCH = {"kv_remote_fetch": True, "kv_remote_fetch_min_tokens": 64, "kv_remote_fetch_timeout_s": 2.0}
PROMPT_CHARS = 200  # the tiny model's byte tokenizer (context 256): 200 tokens, 12 full blocks of 16


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    cluster = start_serving_cluster(model, BASE_PORT, HTTP_PORT, app_args=FETCH)
    try:
        yield cluster
    finally:
        cluster.stop()


def complete(url: str, prompt: str) -> str:
    r = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                                                     "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def counter(nodes: RayNodes, node: str, name: str, **labels: str) -> float:
    try:
        return metric_sum(scrape(f"http://127.0.0.1:{nodes.nodes[node].metrics_port}/metrics"), name, **labels)
    except requests.RequestException:  # the node's metrics agent is gone (a killed node)
        return 0.0


def text(seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PROMPT_CHARS))


def held_by_a(nodes: RayNodes, url: str, prompt: str) -> str:
    """Have the replica on a compute `prompt`, and wait until the index has heard of it (a's KV
    events are exported); the answer."""
    before = counter(nodes, "a", "ray_qkv_kv_events_total")
    answer = complete(url, prompt)
    wait_until(lambda: counter(nodes, "a", "ray_qkv_kv_events_total") > before, 30, "a's KV events to reach the index")
    return answer


def test_a_prefix_computed_on_one_node_is_fetched_by_the_other_and_a_lost_peer_is_computed_around(
        nodes: RayNodes) -> None:
    urls = replica_urls(nodes)
    assert set(urls) == {"a", "b"}, urls
    first = text(1)
    expected = held_by_a(nodes, urls["a"], first)
    assert complete(urls["b"], first) == expected
    # b's metrics reach its node's endpoint within Ray's report interval
    wait_until(lambda: counter(nodes, "b", "ray_qkv_kv_remote_fetch_blocks_total") >= 10, 30,
               "b to count the blocks it fetched from a")
    assert counter(nodes, "b", "ray_qkv_kv_remote_fetch_fallbacks_total") == 0
    # b's prompt ran through the fetched blocks. The engine's totals reach the counter on the
    # replica's gauge refresh (every 2 s), later than the fetch's own counters.
    wait_until(lambda: counter(nodes, "b", "ray_qkv_prefix_cache_hits_total") >= 10 * 16, 30,
               "b to count the prompt tokens it found in its cache")

    # The peer goes away after the index heard of its blocks: b computes the prompt itself and takes
    # no block. The prompt ends in exactly one counted outcome: a fallback (b asked the dead peer:
    # unavailable or timeout) or a skip (the index had forgotten a: none; it did not answer in
    # time: index). Which one depends on timing; that there is one, and only one, does not.
    def outcomes() -> float:
        return (counter(nodes, "b", "ray_qkv_kv_remote_fetch_fallbacks_total")
                + counter(nodes, "b", "ray_qkv_kv_remote_fetch_skipped_total"))

    fetched, before = counter(nodes, "b", "ray_qkv_kv_remote_fetch_blocks_total"), outcomes()
    second = text(2)
    expected = held_by_a(nodes, urls["a"], second)
    killed, _ = nodes.kill("a")
    assert killed > 0
    assert complete(urls["b"], second) == expected  # within the request's timeout: no hang
    wait_until(lambda: outcomes() > before, 30, "b to count the prompt's outcome")
    assert outcomes() == before + 1
    assert counter(nodes, "b", "ray_qkv_kv_remote_fetch_blocks_total") == fetched
