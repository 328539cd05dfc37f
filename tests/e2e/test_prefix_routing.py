"""Prefix caching end to end on real Ray Serve with two engine replicas: `cached_tokens` in the
usage (stream and not), the hit counter on Ray's metrics endpoint, and the prefix-aware router
sending a shared prefix to one replica while unrelated traffic is balanced by load (the router's
own record of its picks)."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from tests.support.serve_fixtures import engine_replica_ids, engine_replica_ports, router_picks, scrape, send_completion, \
    serve_on_local_ray, wait_until, write_tiny_model

pytestmark = pytest.mark.slow

HTTP_PORT, DASHBOARD_PORT, METRICS_PORT = 19000, 19001, 19002
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
BLOCK = 16
SYSTEM = ("You are the helpful assistant of a bakery. Answer questions about bread, opening hours and "
          "prices in one short sentence, politely, and never invent a product we do not sell. ")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    args = {"model": str(model), "num_replicas": 2, "max_num_seqs": 8, "block_size": BLOCK,
            "engine_num_cpus": 0.5, "router_num_cpus": 0.25, "torch_threads": 1}
    with serve_on_local_ray(args, HTTP_PORT, DASHBOARD_PORT, METRICS_PORT) as (base, _):
        # HAProxy learns of the router a moment after the replicas answer: until then it balances
        # by itself. Wait until a request goes through the router (a POST: HAProxy consults the
        # router for those; /tokenize leaves the engine's counters alone).
        from ray import serve

        router = serve.get_deployment_handle("PrefixRoute", app_name="qkv")
        wait_until(lambda: requests.post(f"{base}/tokenize", json={"prompt": "probe"}, timeout=10).ok
                   and router.routed_requests.remote().result(timeout_s=10) > 0, 60, "HAProxy to use the router")
        yield base


CACHED_SO_FAR = [0]  # cached_tokens of every request sent by this module
SENT = [0]  # requests sent by this module


def complete(url: str, prompt: str, stream: bool = False) -> dict[str, Any]:
    """The usage of one completion (greedy, 4 tokens)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text[:300]
    if stream:
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
    else:
        usage = r.json()["usage"]
    SENT[0] += 1
    CACHED_SO_FAR[0] += usage["prompt_tokens_details"]["cached_tokens"]
    return usage


def per_replica(name: str) -> Counter[str]:
    totals: Counter[str] = Counter()
    for n, labels, value in scrape(METRICS_URL):
        if n == name:
            totals[labels["replica"]] += value
    return totals


def test_the_second_request_with_a_long_prompt_reports_cached_tokens(url: str) -> None:
    """Sent to one replica's own HTTP edge: through HAProxy the second request may rightly land on
    the other replica (HAProxy balances by itself when the router is slow to answer, as under a
    loaded CI machine), and report 0."""
    ports = wait_until(lambda: (p := engine_replica_ports()) and len(p) == 2 and p, 60, "HAProxy to list both replicas")
    url = f"http://127.0.0.1:{ports[0]}"
    prompt = "Story time. " + SYSTEM
    first = complete(url, prompt)
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    full = (first["prompt_tokens"] - 1) // BLOCK * BLOCK  # full blocks, the last token always computed
    assert complete(url, prompt)["prompt_tokens_details"]["cached_tokens"] == full
    assert complete(url, prompt, stream=True)["prompt_tokens_details"]["cached_tokens"] == full
    # A prompt shorter than one block never hits.
    assert complete(url, "Hi there")["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(url, "Hi there")["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_shared_prefix_lands_on_one_replica_and_unrelated_traffic_spreads(url: str) -> None:
    """From the router's own record of its picks: after the first, every request with the shared
    prefix goes to the replica that computed it, and unrelated requests are balanced by load (two
    random candidates, the less busy first: tests/service/routing/test_prefix_router.py). Where
    the requests ran, and so the cache hits, follows the picks unless HAProxy gave up waiting for
    the router and balanced by itself (it may, under load): checked whenever it did not."""
    # Start from settled counters: every hit so far (the engine counts what the responses report).
    hits_before = wait_until(lambda: (c := per_replica("ray_qkv_prefix_cache_hits_total")).total() == CACHED_SO_FAR[0]
                             and c, 60, "the earlier hits on Ray's metrics endpoint")
    served_before = wait_until(lambda: (c := per_replica("ray_qkv_request_success_total")).total() == SENT[0]
                               and c, 60, "the earlier requests on Ray's metrics endpoint")
    picked_before = len(router_picks())  # the module sends far fewer than the record keeps
    n_shared = 6
    usages = [complete(url, f"{SYSTEM}Question {i}: when do you open?") for i in range(n_shared)]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    prompts = [f"#{i:02d}: an unrelated request about something else" for i in range(12)]  # no shared block
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        list(pool.map(lambda p: send_completion(url, p, 16, stream=False), prompts))

    picks = wait_until(lambda: p[picked_before:] if len(p := router_picks()) >= picked_before + n_shared + len(prompts)
                       else None, 60, "the router's record of the picks")
    assert len(picks) == n_shared + len(prompts), picks
    shared, unrelated = picks[:n_shared], picks[n_shared:]
    assert [p["why"] for p in shared] == ["load"] + ["prefix"] * (n_shared - 1), shared
    assert [p["why"] for p in unrelated] == ["load"] * len(prompts), unrelated

    def served() -> Counter[str] | None:
        grown = per_replica("ray_qkv_request_success_total")
        grown.subtract(served_before)
        return grown if grown.total() >= n_shared + len(prompts) else None

    ran = wait_until(served, 60, "the finished requests on Ray's metrics endpoint")
    assert ran.total() == n_shared + len(prompts), ran  # each request ran once
    picked = Counter(p["replica_id"].rsplit("#", 1)[1] for p in picks)
    assert set(+ran) | set(picked) <= engine_replica_ids(), (ran, picked)  # one way of naming replicas
    if +ran != picked:
        return  # HAProxy balanced some by itself: where they ran says nothing about the router
    assert len({p["replica_id"] for p in shared}) == 1, shared  # the prefix's picks: one replica
    assert cached >= (n_shared - 1) * (len(SYSTEM) // BLOCK) * BLOCK

    def counted() -> Counter[str] | None:
        grown = per_replica("ray_qkv_prefix_cache_hits_total")
        grown.subtract(hits_before)
        return grown if grown.total() >= cached else None

    grown = wait_until(counted, 60, "the prefix hits on Ray's metrics endpoint")
    assert sorted(v for v in grown.values() if v > 0) == [cached], grown  # one replica got every hit
