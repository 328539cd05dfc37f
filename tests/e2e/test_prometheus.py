"""A real Prometheus (Debian's `prometheus`) scrapes the service through Ray's metrics pipeline,
configured by deploy/prometheus.yml; after known traffic its HTTP API reports the generated-token
count and rate, and a TTFT histogram consistent with what the clients saw. The Grafana
dashboard's queries run against the same server.

Nothing here bounds a duration: each check follows from counts, from the samples Prometheus
holds, or from each request's engine TTFT lying inside its client's. How close the engine's TTFT
is to the client's (the HTTP path's cost) is measured by loadtests/benchmarks/bench_service.py.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.prom_server import DEPLOY_CONFIG, PrometheusServer, config_for_session, promtool_check
from tests.support.requirements import required
from tests.support.serve_fixtures import REPO, send_completion, send_concurrently, serve_on_local_ray, wait_until, \
    write_tiny_model

pytestmark = pytest.mark.slow

HTTP_PORT, DASHBOARD_PORT, METRICS_PORT, PROMETHEUS_PORT = 18520, 18521, 18522, 18523
MODEL = "tiny"  # served model name: the checkpoint directory's name
SEL = f'{{model_name="{MODEL}"}}'
WARMUP_REQUESTS, BURST_REQUESTS, MAX_TOKENS = 2, 32, 128
SCRAPE_S = 1
TOKENS = f"ray_qkv_generation_tokens_total{SEL}"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "qkv-serve.json"


def require_prometheus() -> None:
    """Skip locally, fail in CI, when the Prometheus binaries are missing."""
    required(bool(shutil.which("prometheus") and shutil.which("promtool")),
             "prometheus/promtool not installed (apt-get install prometheus; .ci/run does it)")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require_prometheus()
    model = write_tiny_model(tmp_path_factory.mktemp("model") / MODEL)
    # One sequence at a time, everything admitted to the engine: requests of a burst queue
    # inside the engine, so TTFTs are long and spread, and the engine's TTFT differs from the
    # client's only by the HTTP path.
    args = {"model": str(model), "max_num_seqs": 1, "max_ongoing_requests": 64,
            "engine_num_cpus": 1, "router_num_cpus": 0.25}
    with serve_on_local_ray(args, HTTP_PORT, DASHBOARD_PORT, METRICS_PORT) as (url, session_dir):
        yield url, session_dir


@pytest.fixture(scope="module")
def prom(service: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    _, session_dir = service
    with PrometheusServer(config_for_session(session_dir, SCRAPE_S), tmp_path_factory.mktemp("prom"), PROMETHEUS_PORT) as p:
        yield p


@pytest.fixture(scope="module")
def traffic(service: Any, prom: PrometheusServer) -> dict[str, Any]:
    """Warm-up requests one by one, then a burst; returns what the clients saw and the window
    [t_end - window_s, t_end] that holds the whole burst: it starts once Prometheus holds the
    warm-up's total, and holds a scrape of that flat counter before the burst began (every
    series), and it ends once Prometheus holds the totals after it."""
    url, _ = service
    warmup = [send_completion(url, f"warm-up {i}", MAX_TOKENS) for i in range(WARMUP_REQUESTS)]
    prom.wait_for(f"sum({TOKENS})", WARMUP_REQUESTS * MAX_TOKENS)
    t_start = time.time()
    wait_until(lambda: (first := prom.scalar(f"min(timestamp({TOKENS}))")) is not None and first > t_start, 60,
               "a scrape of the flat counter after the window's start")
    burst = send_concurrently(url, BURST_REQUESTS, MAX_TOKENS)
    prom.wait_for(f"sum({TOKENS})", (WARMUP_REQUESTS + BURST_REQUESTS) * MAX_TOKENS)
    prom.wait_for(f"sum(ray_qkv_time_to_first_token_seconds_count{SEL})", WARMUP_REQUESTS + BURST_REQUESTS)
    window = math.ceil(time.time() - t_start)  # whole seconds for PromQL; t_end may be a moment ahead
    return {"warmup": warmup, "burst": burst, "window_s": window, "t_end": t_start + window}


def test_deploy_config_passes_promtool(tmp_path: Path) -> None:
    require_prometheus()
    result = promtool_check(DEPLOY_CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_every_target_ray_discovered(service: Any, prom: PrometheusServer) -> None:
    _, session_dir = service
    discovered = json.loads((session_dir / "prom_metrics_service_discovery.json").read_text())
    targets = {t for group in discovered for t in group["targets"]}
    assert any(t.endswith(f":{METRICS_PORT}") for t in targets), targets

    def all_up() -> list[dict[str, Any]] | None:
        active = prom.active_targets()
        seen = {t["labels"]["instance"] for t in active}
        return active if seen >= targets and all(t["health"] == "up" for t in active) else None

    active = wait_until(all_up, 60, f"targets {sorted(targets)} up")
    assert {t["labels"]["job"] for t in active} == {"ray"}


def test_start_up_phases_and_the_kv_capacity_are_scraped(service: Any, prom: PrometheusServer) -> None:
    """Each start-up phase's time (a CPU engine: loading the weights and allocating the KV cache;
    no profiling run there) and the KV capacity /v1/models states, through Ray and Prometheus."""
    url, _ = service
    card = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    phases = wait_until(lambda: {s["metric"]["phase"]: float(s["value"][1])
                                 for s in prom.query(f"ray_qkv_startup_seconds{SEL}")} or None, 60,
                        "qkv_startup_seconds in Prometheus")
    assert set(phases) == {"load", "kv_cache"}, phases
    assert all(math.isfinite(v) and v >= 0 for v in phases.values()), phases
    capacity = prom.wait_for(f"sum(ray_qkv_kv_cache_capacity_tokens{SEL})", card["kv_cache"]["capacity_tokens"])
    assert capacity == card["kv_cache"]["num_blocks"] * card["kv_cache"]["block_size"] > 0


def test_generated_tokens_count_and_rate_match_the_traffic(prom: PrometheusServer, traffic: dict[str, Any]) -> None:
    burst_tokens = sum(r.completion_tokens for r in traffic["burst"])
    total = burst_tokens + sum(r.completion_tokens for r in traffic["warmup"])
    assert burst_tokens == BURST_REQUESTS * MAX_TOKENS
    at, w = traffic["t_end"], traffic["window_s"]
    assert prom.scalar(f"sum({TOKENS})", at) == total
    delta = prom.scalar(f"sum({TOKENS}) - sum({TOKENS} offset {w}s)", at)
    assert delta == burst_tokens
    # rate() takes each series' increase between its first and last sample in the window (the
    # window holds a flat scrape before the burst and the total after it: together exactly the
    # burst) and extrapolates it towards the window's edges, never past them: so rate * w lies
    # between the burst and each series' increase scaled by w over its samples' span.
    rate = prom.scalar(f"sum(rate({TOKENS}[{w}s]))", at)
    assert rate is not None
    most = 0.0
    for series in prom.query(f"{TOKENS}[{w}s]", at):
        (t0, v0), (t1, v1) = series["values"][0], series["values"][-1]
        if float(v1) > float(v0):
            most += (float(v1) - float(v0)) * w / (float(t1) - float(t0))
    assert burst_tokens * 0.999 <= rate * w <= most * 1.001, (rate, w, most)
    finished = prom.scalar(f'sum(ray_qkv_request_success_total{{model_name="{MODEL}",finished_reason="length"}})', at)
    assert finished == WARMUP_REQUESTS + BURST_REQUESTS


def _bucket_edges(prom: PrometheusServer) -> list[float]:
    series = prom.query(f"ray_qkv_time_to_first_token_seconds_bucket{SEL}")
    return sorted({float(s["metric"]["le"]) for s in series})


def _bucket_of(edges: list[float], x: float) -> tuple[float, float]:
    """(lower, upper] edges of the histogram bucket holding `x`."""
    lower = 0.0
    for upper in edges:
        if x <= upper:
            return lower, upper
        lower = upper
    return lower, math.inf


def test_ttft_histogram_agrees_with_what_clients_saw(prom: PrometheusServer, traffic: dict[str, Any]) -> None:
    """The engine's TTFT of a request lies inside its client's (it arrives after the client sent
    it, and its first token leaves before the client reads it), so for every bucket the burst's
    engine TTFTs at or under its edge are at least the clients' at or under it, and the p50 lies in
    a bucket that starts below the clients' p50. Counted from the exact increase of each bucket
    over the window (no rate extrapolation)."""
    client = sorted(r.ttft for r in traffic["burst"])
    rank = math.ceil(0.5 * len(client))  # histogram_quantile's rank: the 16th of 32
    client_p50 = client[rank - 1]
    at, w = traffic["t_end"], traffic["window_s"]
    buckets = f"ray_qkv_time_to_first_token_seconds_bucket{SEL}"
    increase = f"sum by (le) ({buckets} - {buckets} offset {w}s)"
    engine = {float(s["metric"]["le"]): float(s["value"][1]) for s in prom.query(increase, at)}
    assert engine[math.inf] == BURST_REQUESTS, engine
    for edge, count in engine.items():
        assert count >= sum(t <= edge for t in client), (edge, engine, client)
    p50 = prom.scalar(f"histogram_quantile(0.5, {increase})", at)
    assert p50 is not None and not math.isnan(p50)
    low, _ = _bucket_of(_bucket_edges(prom), p50)
    assert low < client_p50, f"Prometheus TTFT p50 {p50:.3f}s, clients' p50 {client_p50:.3f}s, engine buckets {engine}"


# Counters that start only with their first event, which this module's traffic never causes: a
# query of them alone is empty here.
NOT_STARTED_HERE = {"ray_qkv_spec_decode_": "no speculative_config",
                    "ray_qkv_prefix_cache_hits_total": "no prompt shares a full block with another",
                    "ray_qkv_num_preemptions_total": "the KV cache never runs out",
                    "ray_qkv_tenant_": "no api_keys_file (tests/e2e/test_tenancy_service.py scrapes them)",
                    "ray_qkv_mm_": "a text model (tests/model/loading/test_vision_qwen2_vl.py checks the counters follow the engine)"}


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(panel["title"], t["expr"]) for panel in dash["panels"] for t in panel["targets"]]


def test_dashboard_queries_are_valid_and_have_data(
        service: Any, prom: PrometheusServer, traffic: dict[str, Any]) -> None:
    """Every panel shows something under the default (HAProxy) serving path: a query of a metric
    that only Serve's Python proxy exports, or of a label value HAProxy's counters never carry, is
    empty here (tests/docs/test_docs_sources.py checks the names without a service)."""
    url, _ = service
    bad = requests.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert bad.status_code == 400  # so the error panels have a series
    prom.wait_for(f'sum(ray_qkv_http_responses_total{{model_name="{MODEL}",status_code="400"}})', 1)
    prom.wait_for('sum(ray_serve_num_http_error_requests_total{error_code="400"})', 1)
    for new in (f'ray_qkv_http_responses_total{{model_name="{MODEL}",status_code="400"}}',
                'ray_serve_num_http_error_requests_total{error_code="400"}'):  # rate() needs two samples of each
        wait_until(lambda: (n := prom.scalar(f"min(count_over_time({new}[1m]))")) is not None and n >= 2, 60,
                   f"two samples of {new}")
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    empty = []
    for title, expr in exprs:
        concrete = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
        assert "$" not in concrete, expr
        if not prom.query(concrete) and not any(m in expr for m in NOT_STARTED_HERE):  # raises on bad PromQL
            empty.append(f"{title}: {concrete}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
