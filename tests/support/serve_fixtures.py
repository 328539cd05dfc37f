"""Helpers for the end-to-end tests of load, monitoring and scale-out (tests/e2e/test_prometheus.py,
tests/e2e/test_cluster.py, tests/e2e/test_locust_smoke.py): a real Ray Serve service on loopback,
known traffic sent to it, and Ray's Prometheus endpoints scraped.

Ports are pinned in 185xx so that these modules never collide with each other or with the
default 8000/8265/6379 of a developer's own cluster.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # loadtests/ is not installed

from loadtests.lib.openai_workload import RequestResult, read_json, read_stream  # noqa: E402

from tests.support.polling import wait_until  # noqa: E402  (the e2e tests import it from here too)

logger = logging.getLogger(__name__)

# Fast metrics for tests: Ray's default report interval is 10 s.
METRICS_INTERVAL_MS = 1000
TINY_MODEL = {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_position": 256}


def write_tiny_model(path: Path) -> Path:
    """A tiny random-weight checkpoint (byte tokenizer), fast enough for a 2-core CPU."""
    from tests.support.local_serve import write_tiny_checkpoint

    return write_tiny_checkpoint(path, **TINY_MODEL)


@contextmanager
def serve_on_local_ray(app_args: dict[str, Any], http_port: int, dashboard_port: int,
                       metrics_port: int, num_cpus: float = 2) -> Iterator[tuple[str, Path]]:
    """Run `service.app:build_app(app_args)` on a new local Ray with its dashboard (which writes
    the Prometheus service-discovery file); yields (base URL, Ray session directory).
    Serve and Ray are shut down on exit, whatever happened."""
    import ray
    from ray import serve

    from service.app import build_app
    from service.launch import reap_orphaned_haproxy
    from tests.support.local_serve import stop_shared_service

    stop_shared_service()  # one Ray per process: this one has its own settings
    started = time.time()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_port=dashboard_port,
             _metrics_export_port=metrics_port, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
             _system_config={"metrics_report_interval_ms": METRICS_INTERVAL_MS})
    try:
        session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app(app_args), name="qkv", route_prefix="/")
        url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: _healthy(url), 60, f"{url}/health")
        yield url, session_dir
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            reap_orphaned_haproxy(started)  # a HAProxy Ray left running would hold Serve's ports


def health_status(url: str) -> int | None:
    """The status code of `url`/health; None when nothing answers."""
    try:
        return requests.get(f"{url}/health", timeout=10).status_code
    except requests.RequestException:
        return None


def _healthy(url: str) -> bool:
    return health_status(url) == 200


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of a server-sent-event stream's lines: parsed JSON, and "[DONE]"."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def read_rayservice(name: str) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, Any]]:
    """deploy/`name`, checked as a KubeRay RayService whose serveConfigV2 is a valid Serve config of
    one qkv-serve app with valid arguments and whose cluster has token auth and one worker group of
    one container: (the document, the app's AppArgs, the rayClusterConfig, the worker container)."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from service.app import AppArgs

    doc = yaml.safe_load((REPO / "deploy" / name).read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "service.app:build_app"
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    return doc, AppArgs.model_validate(app.args), cluster, container


def send_completion(url: str, prompt: str, max_tokens: int, stream: bool = True,
                    timeout_s: float = 120) -> RequestResult:
    """One `/v1/completions` request with `ignore_eos` (exactly `max_tokens` tokens); raises
    if it fails, so that traffic the tests count is traffic that was served."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(scenario="test", stream=stream, start=time.time())
    t0 = time.perf_counter()
    with requests.post(f"{url}/v1/completions", json=body, stream=stream, timeout=timeout_s) as resp:
        result.status = resp.status_code
        assert resp.status_code == 200, f"HTTP {resp.status_code}: {resp.text[:300]}"
        if stream:
            read_stream(resp.iter_lines(), result, t0)
        else:
            read_json(resp.json(), result)
    result.e2e = time.perf_counter() - t0
    assert result.completion_tokens == max_tokens, result
    return result


def send_concurrently(url: str, n: int, max_tokens: int, stream: bool = True) -> list[RequestResult]:
    """`n` requests at once, with distinct prompts; all must succeed."""
    prompts = [f"request {i}: the quick brown fox" for i in range(n)]
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda p: send_completion(url, p, max_tokens, stream), prompts))


def scrape(metrics_url: str) -> list[tuple[str, dict[str, str], float]]:
    """All samples of a Prometheus text endpoint as (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(metrics_url, timeout=10).text
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def engine_replica_ports() -> list[int]:
    """The HTTP ports of the app's engine replicas, as HAProxy's configuration on this node lists
    them ([] before HAProxy has one)."""
    import ray

    config = Path(f"/tmp/haproxy-serve/{ray.get_runtime_context().get_node_id()}/haproxy.cfg")
    if not config.exists():
        return []
    backend = config.read_text().split("backend http-qkv\n", 1)[-1].split("\nbackend ", 1)[0]
    return [int(port) for port in re.findall(r"server SERVE_REPLICA_qkv-EngineDeployment-\S+ [\d.]+:(\d+)", backend)]


def router_picks(app_name: str = "qkv") -> list[dict[str, Any]]:
    """The prefix router's own record of its latest picks, oldest first (`PrefixRoute.recent_picks`:
    each request's model and adapter, the replica chosen and why): what a routing test checks,
    rather than where requests landed, which depends on load (HAProxy balances by itself when the
    router is slow to answer)."""
    from ray import serve

    router = serve.get_deployment_handle("PrefixRoute", app_name=app_name)
    return router.recent_picks.remote().result(timeout_s=30)


def engine_replica_ids(app_name: str = "qkv") -> set[str]:
    """The unique ids of the app's live engine replicas: the `replica` label of their metrics on
    Ray's endpoint, and the last part of a `router_picks` replica_id."""
    import ray

    prefix = f"SERVE_REPLICA::{app_name}#EngineDeployment#"
    return {a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}
