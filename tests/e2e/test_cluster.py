"""The docs' cluster recipe, run as written: the four shell blocks of docs/deployment.md's "A cluster
of several machines" (head, worker, deploying machine, stop) are read from that page and executed
with bash on this machine, so a changed command on the page is what this test runs.

Each block runs as its own "machine": its own HOME (the head's token lives only in the head's
~/.ray/auth_token and reaches the others through RAY_AUTH_TOKEN, as the page says). What the
test changes, and only this: HEAD_IP -> 127.0.0.1, HEAD_TOKEN -> the head's token, the page's
ports -> this module's ports (two nodes share one machine), `ray start` gets a private
`--temp-dir` and test resources, and deploy/serve.yaml -> a copy with a tiny model and one engine
replica pinned to each node by a custom resource. `ray stop` stops every Ray on a machine (other
test runs included), so the last block is checked to be exactly `ray stop` and replaced by
stopping the processes of this test's Ray (those naming its temp dir, and their children).

Also: the KubeRay RayService carries a Serve config that Serve and the builder accept, and token
authentication.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
import yaml

from service.launch import reap_orphaned_haproxy
from tests.support.ray_nodes import answers, client_server_pattern, matching_processes, stop_processes
from tests.support.serve_fixtures import REPO, metric_sum, read_rayservice, scrape, send_concurrently, wait_until, \
    write_tiny_model

GCS_PORT, DASHBOARD_PORT, HEAD_METRICS_PORT, WORKER_METRICS_PORT, HTTP_PORT = 18900, 18901, 18902, 18903, 18904
HEAD_AGENT_PORT, WORKER_AGENT_PORT, CLIENT_SERVER_PORT = 18905, 18906, 18907
SLOT = "qkv_engine_slot"  # one per node: at most one engine replica fits on a node
REQUESTS, MAX_TOKENS = 24, 16
BIN = Path(sys.executable).parent
BLOCK_HEADS = ("# on the head", "# on each worker", "# on the machine that deploys", "# on every node")


RECIPE_PAGE, RECIPE_SECTION = REPO / "docs" / "deployment.md", "## A cluster of several machines"


def recipe_blocks() -> list[str]:
    """The bash blocks of docs/deployment.md's "A cluster of several machines" section (up to the
    next `## ` heading, its `###` sub-sections included), in order."""
    text = RECIPE_PAGE.read_text()
    section = text.split(f"\n{RECIPE_SECTION}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def commands(block: str) -> list[str]:
    """A block's command lines (comments and blank lines dropped, trailing comments cut)."""
    lines = (line.split(" #", 1)[0].strip() for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def serve_config(model: Path) -> dict[str, Any]:
    """deploy/serve.yaml with the tiny model, the test's HTTP port, two engine replicas that
    each need one SLOT, and fractional CPUs."""
    config = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    config["http_options"]["port"] = HTTP_PORT
    (app,) = config["applications"]
    app["args"] |= {"model": str(model), "num_replicas": 2, "max_num_seqs": 8, "engine_num_cpus": 0.5,
                    "router_num_cpus": 0.25, "torch_threads": 1}
    app["deployments"] = [{"name": "EngineDeployment",
                           "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0, "resources": {SLOT: 1}}}]
    return config


class Machines:
    """Runs the recipe's blocks as separate machines on loopback; knows the test's substitutions."""

    def __init__(self, tmp: Path, config_file: Path) -> None:
        self.tmp, self.config_file = tmp, config_file
        # Ray's own directory stays short: its socket paths must fit AF_UNIX's 107 bytes, which a
        # pytest tmp path (/tmp/pytest-of-root/pytest-NNN/...) can exceed.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="qkv-ray-", dir="/tmp"))
        self.token = ""

    def home(self, name: str) -> Path:
        home = self.tmp / name
        home.mkdir(exist_ok=True)
        return home

    def script(self, block: str, metrics_port: int, ray_start_flags: str) -> str:
        text = "\n".join(commands(block))
        for old, new in (("HEAD_IP", "127.0.0.1"), ("HEAD_TOKEN", self.token), ("0.0.0.0", "127.0.0.1"),
                         (":6379", f":{GCS_PORT}"), ("=6379", f"={GCS_PORT}"), (":8265", f":{DASHBOARD_PORT}"),
                         ("--metrics-export-port=8080", f"--metrics-export-port={metrics_port}"),
                         ("deploy/serve.yaml", str(self.config_file))):
            text = text.replace(old, new)
        common = (f"--temp-dir={self.temp_dir} --node-ip-address=127.0.0.1 --num-cpus=1 "
                  f"--resources='{{\"{SLOT}\": 1}}' --object-store-memory=100000000 ")
        return re.sub(r"^ray start ", f"ray start {common}{ray_start_flags} ", text, flags=re.M)

    def run(self, block: str, home: str, metrics_port: int = 0, ray_start_flags: str = "") -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env |= {"HOME": str(self.home(home)), "PATH": f"{BIN}:{env['PATH']}", "PYTHONPATH": str(REPO)}
        script = self.script(block, metrics_port, ray_start_flags)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-3000:]}"
        return done.stdout

    def stop(self) -> list[psutil.Process]:
        """Stop this test's Ray only: processes naming its temp dir, its Ray client server, and
        their children; returns those left running."""
        mine = re.escape(str(self.temp_dir)) + "|" + client_server_pattern(CLIENT_SERVER_PORT)
        return stop_processes(lambda: matching_processes(mine))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The head, one worker and the deployment, from the recipe's blocks; stopped at the end."""
    blocks = recipe_blocks()
    assert len(blocks) == len(BLOCK_HEADS), blocks
    assert all(b.startswith(h) for b, h in zip(blocks, BLOCK_HEADS)), blocks
    tmp = tmp_path_factory.mktemp("cluster")
    config_file = tmp / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(write_tiny_model(tmp / "tiny"))))
    machines = Machines(tmp, config_file)
    head, worker, deploy, stop = blocks
    started = time.time()
    try:
        machines.run(head, "head", HEAD_METRICS_PORT,
                     f"--dashboard-port={DASHBOARD_PORT} --dashboard-agent-listen-port={HEAD_AGENT_PORT} "
                     f"--ray-client-server-port={CLIENT_SERVER_PORT} --min-worker-port=19420 --max-worker-port=19459")
        wait_until(lambda: answers(f"http://127.0.0.1:{DASHBOARD_PORT}/api/version"), 60,
                   f"the head's dashboard (log: {machines.temp_dir}/session_latest/logs/dashboard.log)")
        machines.token = (machines.home("head") / ".ray" / "auth_token").read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", machines.token)
        machines.run(worker, "worker", WORKER_METRICS_PORT,
                     f"--dashboard-agent-listen-port={WORKER_AGENT_PORT} --min-worker-port=19460 --max-worker-port=19499")
        out = machines.run(deploy, "deployer")
        exports = [c for c in commands(deploy) if c.startswith("export ")]
        status = [c for c in commands(deploy) if c.startswith("serve status")]
        assert len(status) == 1 and "serve deploy" in deploy, deploy

        def running() -> str | None:  # the recipe's `serve status`, repeated until RUNNING
            text = machines.run("\n".join([*exports, status[0]]), "deployer")
            return text if _app_running(text) else None

        # The dashboard's Serve API (what `serve status` reads) is polled until the replicas run:
        # each `serve status` is a fresh Python process that competes with the starting replicas
        # for this machine's two cores. Then the recipe's command itself must show RUNNING.
        wait_until(lambda: _details_running(machines.token), 240, "the application's replicas to run", every_s=1)
        out = wait_until(running, 60, "`serve status` to show the application RUNNING", every_s=3)
        yield machines, out
    finally:
        assert commands(stop) == ["ray stop"], stop
        left = machines.stop()
        reap_orphaned_haproxy(started)  # a HAProxy whose Ray is gone (service/launch.py) holds Serve's ports
        shutil.rmtree(machines.temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's Ray still running: {left}"


def _details_running(token: str) -> bool:
    """The dashboard's Serve details show the app RUNNING with both engine replicas RUNNING."""
    try:
        r = requests.get(f"http://127.0.0.1:{DASHBOARD_PORT}/api/serve/applications/",
                         headers={"Authorization": f"Bearer {token}"}, timeout=10)
    except requests.RequestException:
        return False
    if r.status_code != 200:
        return False
    app = (r.json().get("applications") or {}).get("qkv") or {}
    engine = (app.get("deployments") or {}).get("EngineDeployment") or {}
    replicas = [rep for rep in engine.get("replicas") or [] if rep.get("state") == "RUNNING"]
    return app.get("status") == "RUNNING" and len(replicas) == 2


def _app_running(status_text: str) -> bool:
    status = yaml.safe_load(status_text)
    app = (status.get("applications") or {}).get("qkv") or {}
    engine = (app.get("deployments") or {}).get("EngineDeployment") or {}
    return app.get("status") == "RUNNING" and engine.get("replica_states", {}).get("RUNNING") == 2


@pytest.mark.slow
def test_the_dashboard_refuses_requests_without_the_token(cluster: tuple[Machines, str]) -> None:
    machines, _ = cluster
    url = f"http://127.0.0.1:{DASHBOARD_PORT}/api/jobs/"
    assert requests.get(url, timeout=10).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer " + "0" * 64}, timeout=10).status_code == 403
    job = {"entrypoint": "echo pwned"}
    assert requests.post(url, json=job, timeout=10).status_code == 401
    assert requests.get(url, headers={"Authorization": f"Bearer {machines.token}"}, timeout=10).status_code == 200


@pytest.mark.slow
def test_both_nodes_serve_and_their_metrics_add_up_to_the_traffic(cluster: tuple[Machines, str]) -> None:
    machines, status = cluster
    assert _app_running(status)
    results = send_concurrently(f"http://127.0.0.1:{HTTP_PORT}", REQUESTS, MAX_TOKENS, stream=True)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    urls = [f"http://127.0.0.1:{port}/metrics" for port in (HEAD_METRICS_PORT, WORKER_METRICS_PORT)]

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
    # Prometheus discovery: the head's dashboard lists both nodes' metrics ports.
    discovery = yaml.safe_load((machines.temp_dir / "prom_metrics_service_discovery.json").read_text())
    targets = {t.rsplit(":", 1)[1] for group in discovery for t in group["targets"]}
    assert {str(HEAD_METRICS_PORT), str(WORKER_METRICS_PORT)} <= targets, discovery


def test_rayservice_carries_a_valid_serve_config_gpu_workers_and_token_auth() -> None:
    _, args, cluster, container = read_rayservice("rayservice.yaml")
    assert args.accelerator == "auto" and args.autoscaling_config is not None
    version = tuple(int(x) for x in cluster["rayVersion"].split("."))
    assert version >= (2, 52, 0), "KubeRay's token auth needs Ray >= 2.52"
    (workers,) = cluster["workerGroupSpecs"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    from service.launch import SERVING_ENV

    for group in (cluster["headGroupSpec"], workers):
        env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env == SERVING_ENV, "the pods run the serving path's Ray Serve settings"
        port = group["rayStartParams"]["metrics-export-port"]
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == int(port)
