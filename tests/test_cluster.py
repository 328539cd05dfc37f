"""Scale-out on a two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): the multi-node
recipe of the README (`serve deploy` of a config to the head's dashboard), one engine replica
pinned to each node by a custom resource, known traffic, then each node's own metrics endpoint
scraped: both replicas served requests, and the two nodes' counters add up to the traffic.
Also: the KubeRay RayService carries a Serve config that Serve and the builder accept.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_fixtures import REPO, metric_sum, scrape, send_concurrently, wait_until, write_tiny_model

HTTP_PORT, DASHBOARD_PORT = 18540, 18541
SLOT = "qkv_engine_slot"  # one per node: at most one engine replica fits on a node
REQUESTS, MAX_TOKENS = 24, 16


def serve_config(model: Path) -> dict[str, Any]:
    """Two engine replicas, each needing one SLOT; one HTTP proxy (two nodes share 127.0.0.1)."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": HTTP_PORT},
        "applications": [{
            "name": "qkv",
            "route_prefix": "/",
            "import_path": "service.app:build_app",
            "args": {"model": str(model), "num_replicas": 2, "max_num_seqs": 8, "engine_num_cpus": 0.5,
                     "ingress_num_cpus": 0.25},
            "deployments": [{"name": "EngineDeployment",
                             "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0, "resources": {SLOT: 1}}}],
        }],
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Head and worker node, each with one SLOT; the service deployed with `serve deploy`."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    tmp = tmp_path_factory.mktemp("cluster")
    config_file = tmp / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(write_tiny_model(tmp / "tiny"))))
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {SLOT: 1}, "include_dashboard": True, "dashboard_port": DASHBOARD_PORT,
        "_system_config": {"metrics_report_interval_ms": 1000}})
    try:
        c.add_node(num_cpus=1, resources={SLOT: 1})
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level="WARNING")
        deploy = subprocess.run(
            [str(Path(sys.executable).parent / "serve"), "deploy", str(config_file),
             "--address", f"http://127.0.0.1:{DASHBOARD_PORT}"],
            capture_output=True, text=True, timeout=120, check=False)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        wait_until(lambda: _running_engine_replicas() == 2 or None, 180, "two running engine replicas")
        yield f"http://127.0.0.1:{HTTP_PORT}"
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            c.shutdown()


def _running_engine_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get("qkv")
    if app is None or app.status != "RUNNING":
        return 0
    return app.deployments["EngineDeployment"].replica_states.get("RUNNING", 0)


def _node_metrics_urls() -> list[str]:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2, nodes
    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in nodes]


@pytest.mark.slow
def test_both_replicas_serve_and_the_nodes_metrics_add_up_to_the_traffic(cluster: str) -> None:
    results = send_concurrently(cluster, REQUESTS, MAX_TOKENS, stream=True)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    urls = _node_metrics_urls()

    def settled() -> list[Any] | None:
        per_node = [scrape(u) for u in urls]
        done = sum(metric_sum(s, "ray_qkv_request_success_total") for s in per_node)
        return per_node if done == REQUESTS else None

    per_node = wait_until(settled, 60, f"{REQUESTS} finished requests on the nodes' metrics endpoints")
    served = [metric_sum(s, "ray_qkv_request_success_total") for s in per_node]
    replicas = [{lab["replica"] for n, lab, _ in s if n == "ray_qkv_request_success_total"} for s in per_node]
    assert all(x > 0 for x in served), f"requests served per node: {served}"
    assert all(len(r) == 1 for r in replicas) and replicas[0] != replicas[1], replicas
    assert sum(metric_sum(s, "ray_qkv_generation_tokens_total") for s in per_node) == REQUESTS * MAX_TOKENS
    assert sum(metric_sum(s, "ray_qkv_prompt_tokens_total") for s in per_node) == prompt_tokens
    assert sum(metric_sum(s, "ray_qkv_time_to_first_token_seconds_count") for s in per_node) == REQUESTS


def test_rayservice_carries_a_valid_serve_config_and_gpu_workers() -> None:
    from ray.serve.schema import ServeDeploySchema

    from service.app import AppArgs

    doc = yaml.safe_load((REPO / "deploy" / "rayservice.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    config = ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
    (app,) = config.applications
    assert app.import_path == "service.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.accelerator == "auto" and args.autoscaling_config is not None
    cluster = doc["spec"]["rayClusterConfig"]
    (workers,) = cluster["workerGroupSpecs"]
    (container,) = workers["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for group in (cluster["headGroupSpec"], workers):
        port = group["rayStartParams"]["metrics-export-port"]
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == int(port)
