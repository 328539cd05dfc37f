"""Cancellation, overload and metrics of the running service: a real Ray Serve on loopback with
Ray's Prometheus endpoint, and a model slow enough that one long request would keep the engine busy
for about a minute unless it is aborted. Each test leaves the service as it found it (idle, same
config), so they pass in any order; the redeploys, which change the config, have their own service
(test_service_redeploy.py)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tests.support.bursts import burst
from tests.support.local_serve import local_service, write_tiny_checkpoint

pytestmark = pytest.mark.slow

HTTP_PORT = 18330
METRICS_PORT = 18331
MODEL = "slow"
MAX_ONGOING, MAX_QUEUED, RETRY_AFTER = 2, 2, 2
BURST = 16  # concurrent clients of the overload tests
LONG = {"prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}  # ~1 min if not aborted


@pytest.fixture(scope="module")
def app_args(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "slow", max_position=4096, d_model=512,
                                 n_heads=8, n_layers=4, d_ff=2048)
    return {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 4, "num_kv_blocks": 1100,
            "engine_num_cpus": 1, "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED,
            "retry_after_s": RETRY_AFTER}


@pytest.fixture(scope="module")
def base_url(app_args: dict[str, Any]) -> Iterator[str]:
    with local_service(app_args, HTTP_PORT, num_cpus=2, metrics_port=METRICS_PORT) as url:
        yield url


def _scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Ray's metrics endpoint: (sample name, labels that matter) -> value, summed over replicas."""
    text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).text
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("ray_qkv_") and s.labels.get("model_name") == MODEL:
                labels = frozenset((k, v) for k, v in s.labels.items() if k in ("finished_reason", "le"))
                samples[(s.name, labels)] = samples.get((s.name, labels), 0.0) + s.value
    return samples


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _wait_for(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll `check` until it holds; bounded, so a regression fails instead of hanging."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.25)


def _wait_counted(before: dict, what: str, prompt_tokens: int, **finished: int) -> None:
    """Wait until Ray's endpoint shows a test's requests as finished since `before`: `prompt_tokens`
    more prompt tokens and, per finish reason, `finished[reason]` more requests. A test that sends
    requests ends with this, so the next one (in any order) starts from settled counters: they
    reach the endpoint on Ray's next report after the answers, not with them."""
    def grew(now: dict, name: str, **labels: str) -> float:
        return _value(now, name, **labels) - _value(before, name, **labels)

    def counted() -> bool:
        now = _scrape()
        return grew(now, "ray_qkv_prompt_tokens_total") >= prompt_tokens and all(
            grew(now, "ray_qkv_request_success_total", finished_reason=reason) >= n for reason, n in finished.items())
    _wait_for(counted, what)


def _engine_stats() -> dict[str, Any]:
    return serve.get_deployment_handle("EngineDeployment", app_name="qkv").engine_stats.remote().result()


def _idle() -> bool:
    stats = _engine_stats()
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def test_metrics_after_traffic(base_url: str) -> None:
    before = _scrape()
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for _ in range(3):
            r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200
        with http.stream("POST", "/v1/completions", json={"prompt": "hey", "max_tokens": 8, "ignore_eos": True,
                                                           "stream": True}) as r:
            assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")
    prompt_tokens, gen_tokens, requests = 3 * 5 + 3, 4 * 8, 4

    def delta(name: str, **labels: str) -> float:
        return _value(_scrape(), name, **labels) - _value(before, name, **labels)

    # Ray reports each metric on its own: wait for every count asserted below, then compare exactly.
    expected = [("ray_qkv_prompt_tokens_total", {}, prompt_tokens), ("ray_qkv_generation_tokens_total", {}, gen_tokens),
                ("ray_qkv_request_success_total", {"finished_reason": "length"}, requests),
                ("ray_qkv_inter_token_latency_seconds_count", {}, requests * 7),
                *[(f"ray_qkv_{hist}_seconds_count", {}, requests)
                  for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time")]]
    _wait_for(lambda: all(delta(name, **labels) >= n for name, labels, n in expected), "the traffic's counters")
    after = _scrape()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert _value(d, "ray_qkv_prompt_tokens_total") == prompt_tokens
    assert _value(d, "ray_qkv_generation_tokens_total") == gen_tokens
    assert _value(d, "ray_qkv_request_success_total", finished_reason="length") == requests
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert _value(d, f"ray_qkv_{hist}_seconds_count") == requests, hist
        assert _value(d, f"ray_qkv_{hist}_seconds_bucket", le="+Inf") == requests, hist
        assert 0 < _value(d, f"ray_qkv_{hist}_seconds_sum") or hist == "request_queue_time"
    assert _value(d, "ray_qkv_inter_token_latency_seconds_count") == requests * 7  # gaps between 8 tokens
    assert _value(d, "ray_qkv_e2e_request_latency_seconds_sum") >= _value(d, "ray_qkv_time_to_first_token_seconds_sum")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert (f"ray_qkv_{gauge}", frozenset()) in after, gauge
    assert 0.0 <= _value(after, "ray_qkv_kv_cache_usage_perc") <= 1.0


def test_client_disconnect_aborts_the_request(base_url: str) -> None:
    start = _scrape()
    aborted_before = _value(start, "ray_qkv_request_success_total", finished_reason="abort")
    body = LONG | {"stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                           json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        _wait_for(lambda: _engine_stats()["num_running"] == 1, "the request to run")
        # Ray exports each gauge on its own, so the two may show up one export apart
        _wait_for(lambda: _value(_scrape(), "ray_qkv_num_requests_running") == 1, "running gauge = 1")
        _wait_for(lambda: _value(_scrape(), "ray_qkv_kv_cache_usage_perc") > 0, "KV usage gauge > 0")
        assert _engine_stats()["num_running"] == 1  # still the same request, not yet finished
    # leaving the blocks closes the connection mid-stream
    _wait_for(_idle, "the engine to free the aborted request")
    _wait_for(lambda: _value(_scrape(), "ray_qkv_num_requests_running") == 0
              and _value(_scrape(), "ray_qkv_kv_cache_usage_perc") == 0.0, "running and KV gauges = 0")
    _wait_for(lambda: _value(_scrape(), "ray_qkv_request_success_total", finished_reason="abort")
              == aborted_before + 1, "the abort to be counted")
    _wait_counted(start, "the aborted request's prompt tokens", 3, abort=1)


def test_a_non_streamed_request_whose_client_left_is_aborted_and_frees_its_blocks(base_url: str) -> None:
    """Under HAProxy, whose connection to the replica stays open after its client left until a write
    to the client fails: a non-streamed request past its first token starts its response and sends
    a space every 0.25 s (service/server/api.py HeldResponse), so the client's close is noticed and
    the request aborted. Three clients in turn, each closing its socket while its request runs
    (LONG would take about a minute): before its response's first byte, and after it."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    _wait_for(_idle, "an idle engine")
    start = _scrape()
    for close_after_first_byte in (False, True, True):
        _wait_for(_idle, "an idle engine")
        aborted_before = _value(_scrape(), "ray_qkv_request_success_total", finished_reason="abort")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            _wait_for(lambda: _engine_stats()["num_running"] == 1, "the request to run")
            if close_after_first_byte:
                head = sock.recv(4096)
                assert head.startswith(b"HTTP/1.1 200"), head[:200]
        # the client is gone
        _wait_for(_idle, "the engine to abort the request and free its blocks")
        _wait_for(lambda: _value(_scrape(), "ray_qkv_request_success_total", finished_reason="abort")
                  == aborted_before + 1, "the abort to be counted")
    r = httpx.post(f"{base_url}/v1/completions", json=LONG | {"max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text[:300]  # its admission slot is free again
    _wait_counted(start, "the test's requests on Ray's endpoint", 4 * 3, abort=3, length=1)


def test_overload_rejects_the_excess_fast(base_url: str) -> None:
    """Every refusal is back before any admitted request has finished, each admitted stream whole.
    The one order of events here is read from the client's clock: a rewrite that read the engine's
    state instead (every admitted request still held when the last answer came) failed one stress
    run of two, an admitted stream closed by its HAProxy connection after 28 ms, cause not found."""
    # Long enough that all requests arrive while the first ones still run: the rejections come
    # back within about a second on a loaded 2-core machine, 1000 tokens took the four admitted
    # requests 33 s there; 300 tokens keep a margin of ~10x.
    _wait_for(_idle, "an idle engine", timeout_s=60)
    start = _scrape()
    body = {"prompt": "abc", "max_tokens": 300, "ignore_eos": True, "stream": True}
    events = burst(base_url, body, BURST)
    admitted = [e for e in events if e[1] == 200]
    rejected = [e for e in events if e[1] != 200]
    # The replica admits at most max_ongoing + max_queued at once (service/engine/admission.py:
    # Serve's own count lets a few more in under a burst). Serve's router may turn away a few
    # that would fit (its queue count includes requests about to be assigned), never more.
    assert MAX_ONGOING <= len(admitted) <= MAX_ONGOING + MAX_QUEUED
    for _, status, info in rejected:
        assert status == 503
        assert info["retry_after"] == str(RETRY_AFTER)
        error = httpx.Response(503, content=info["body"]).json()["error"]
        assert error["type"] == "overloaded_error" and "overloaded" in error["message"]
    for _, _, info in admitted:
        assert info["body"].endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' in info["body"]
    assert max(t for t, *_ in rejected) < min(t for t, *_ in admitted)
    assert httpx.get(f"{base_url}/health").status_code == 200
    _wait_counted(start, "the admitted requests on Ray's endpoint", 3 * len(admitted), length=len(admitted))
