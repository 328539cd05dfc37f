"""Soak: thousands of mixed requests against one engine replica (real Ray Serve on loopback).

Completions and chats, streamed and not, streams dropped by their client after the first
chunk, and invalid requests, sent from a bounded pool of clients in a fixed (seeded) order.
Nothing may come back as a 5xx, every valid request gets exactly its tokens, every invalid one
the error shape; afterwards the KV pool is completely free and the replica's resident memory
grew less than MAX_RSS_GROWTH from the end of the warm-up to the end of the run.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import pytest
import ray
from ray import serve

from tests.support.serve_fixtures import wait_until, write_tiny_model
from tests.support.local_serve import SharedServe

pytestmark = pytest.mark.slow

MODEL = "soak"
MAX_BODY_BYTES = 16 * 1024
WARMUP_REQUESTS = 400
TOTAL_REQUESTS = 2000
CLIENTS = 24
MAX_RSS_GROWTH = 0.10
CLIENT_TIMEOUT_S = 60.0

Outcome = tuple[str, int]  # (kind, status)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[str]:
    ckpt = write_tiny_model(tmp_path_factory.mktemp("ckpt") / MODEL)
    args = {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 32, "num_kv_blocks": 512,
            "engine_num_cpus": 1, "max_body_bytes": MAX_BODY_BYTES, "max_queued_requests": 4 * CLIENTS}
    with shared_serve(args) as url:
        yield url


def _stats() -> dict[str, Any]:
    return serve.get_deployment_handle("EngineDeployment", app_name="qkv").engine_stats.remote().result(timeout_s=30)


def _kv_free() -> bool:
    s = _stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]


def _engine_process() -> psutil.Process:
    """The engine replica's process, found through Ray's actor table."""
    (pid,) = [a["Pid"] for a in ray._private.state.actors().values()
              if a["ActorClassName"].endswith(":EngineDeployment") and a["State"] == "ALIVE"]
    return psutil.Process(pid)


# ---- the requests ---------------------------------------------------------------------------


def _completion(http: httpx.Client, rng: random.Random) -> Outcome:
    n = rng.randint(1, 8)
    r = http.post("/v1/completions", json={"prompt": f"soak {rng.random()}", "max_tokens": n, "ignore_eos": True})
    assert r.status_code != 200 or r.json()["usage"]["completion_tokens"] == n, r.text[:300]
    return "completion", r.status_code


def _stream(http: httpx.Client, rng: random.Random) -> Outcome:
    n = rng.randint(1, 8)
    body = {"prompt": f"stream {rng.random()}", "max_tokens": n, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    if r.status_code == 200:
        assert data[-1] == "[DONE]" and json.loads(data[-2])["usage"]["completion_tokens"] == n, data[-3:]
    return "stream", r.status_code


def _chat(http: httpx.Client, rng: random.Random) -> Outcome:
    n = rng.randint(1, 8)
    body = {"messages": [{"role": "user", "content": f"chat {rng.random()}"}], "max_tokens": n,
            "ignore_eos": True, "stream": rng.random() < 0.5}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        text = r.read().decode()
    if r.status_code == 200:
        assert text.endswith("data: [DONE]\n\n") if body["stream"] else json.loads(text)["usage"][
            "completion_tokens"] == n, text[-300:]
        assert '"error"' not in text
    return "chat", r.status_code


def _dropped(http: httpx.Client, rng: random.Random) -> Outcome:
    """A stream whose client goes away after the first chunk, while its request still runs."""
    body = {"prompt": f"drop {rng.random()}", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 200:
            assert next(r.iter_lines()).startswith("data: ")
    return "dropped", r.status_code


INVALID: list[tuple[str, str, Any]] = [  # (method, path, json body or raw bytes)
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "other"}),
    ("POST", "/v1/completions", {"prompt": "x" * 300, "max_tokens": 4}),  # past the context
    ("POST", "/v1/completions", {"prompt": "x" * MAX_BODY_BYTES}),
    ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/chat/completions", {"messages": []}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}], "stream": True}),
    ("POST", "/tokenize", {}),
    ("POST", "/detokenize", {"tokens": [10**9]}),
    ("GET", "/v1/completions", None),
    ("POST", "/v1/nothing", {}),
]


def _invalid(http: httpx.Client, rng: random.Random) -> Outcome:
    method, path, body = rng.choice(INVALID)
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    assert 400 <= r.status_code < 500, (path, body if not isinstance(body, dict) else list(body), r.status_code)
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    return "invalid", r.status_code


MIX: list[tuple[Callable[[httpx.Client, random.Random], Outcome], int]] = [
    (_completion, 35), (_stream, 25), (_chat, 15), (_dropped, 10), (_invalid, 15)]


def _run(base_url: str, count: int, seed: int) -> list[Outcome]:
    kinds = random.Random(seed).choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=count)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http, \
            ThreadPoolExecutor(CLIENTS) as pool:
        return list(pool.map(lambda ik: ik[1](http, random.Random(seed * 100_000 + ik[0])), enumerate(kinds)))


def test_soak_mixed_traffic_no_5xx_kv_free_memory_flat(base_url: str) -> None:
    warmup = _run(base_url, WARMUP_REQUESTS, seed=1)
    wait_until(_kv_free, 60, "the KV pool to be free after the warm-up")
    engine = _engine_process()
    rss_warm = engine.memory_info().rss

    outcomes = _run(base_url, TOTAL_REQUESTS, seed=2)
    wait_until(_kv_free, 60, "the KV pool to be completely free")
    rss_end = engine.memory_info().rss

    assert len(outcomes) == TOTAL_REQUESTS
    statuses = Counter(outcome for outcome in warmup + outcomes)
    assert not [s for (_, s) in statuses if s >= 500], statuses
    assert all(s == 200 for (kind, s) in statuses if kind != "invalid"), statuses  # valid ones all served
    assert {kind for kind, _ in outcomes} == {kind.__name__[1:] for kind, _ in MIX}, statuses
    growth = (rss_end - rss_warm) / rss_warm
    assert growth < MAX_RSS_GROWTH, f"engine replica RSS grew {growth:.1%}: {rss_warm >> 20} -> {rss_end >> 20} MiB"
    assert httpx.get(f"{base_url}/health").status_code == 200
