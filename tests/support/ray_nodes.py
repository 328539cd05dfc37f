"""A Ray cluster of several nodes on this machine, for tests of what a cluster does when a node goes
away: a head and workers started with `ray start` on 127.0.0.1, each with its own temp dir and
ports and a custom resource that places replicas on it, and stopped by killing exactly the
processes they started (`ray stop` would stop every Ray on the machine, other test runs included).

A node's processes are those that name its temp dir (the raylet, its agents, the log monitor, the
head's GCS and dashboard) and their children (the worker processes the raylet forks). `kill`
SIGKILLs them, as a machine that loses power would leave its peers; `start` brings the node back
with the same command, as a replaced machine would join.

The application is deployed through the head dashboard's Serve REST API (what `serve deploy`
calls), so the test process never joins the cluster as a driver.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from service.launch import SERVING_ENV, reap_orphaned_haproxy
from tests.support.polling import wait_until

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@dataclass
class Node:
    """One `ray start`: its name, temp dir, resources and the ports it was given."""

    name: str
    temp_dir: Path
    resources: dict[str, float]
    num_cpus: float
    metrics_port: int
    node_manager_port: int
    worker_ports: tuple[int, int]
    head_flags: list[str] = field(default_factory=list)  # only the head's
    client_server_port: int | None = None  # only the head's

    @property
    def is_head(self) -> bool:
        return bool(self.head_flags)

    def processes(self) -> list[psutil.Process]:
        """Every live process of this node: those naming its temp dir (or, the head's Ray client
        server, its port: that one names neither), and their descendants."""
        mine = re.escape(str(self.temp_dir))
        if self.client_server_port is not None:
            mine += "|" + client_server_pattern(self.client_server_port)
        return matching_processes(mine)


def client_server_pattern(port: int) -> str:
    """The command line of a head's Ray client server (`--ray-client-server-port`): it names neither
    the temp dir nor 127.0.0.1 (`--address=<the machine's address>:<GCS port>`)."""
    return rf"ray\.util\.client\.server .*--port={port}\b"


def matching_processes(pattern: str) -> list[psutil.Process]:
    """The live processes whose command line matches the regex `pattern`, and their descendants."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if re.search(pattern, " ".join(proc.info["cmdline"] or [])):
                for p in [proc, *proc.children(recursive=True)]:
                    found[p.pid] = p
        except psutil.Error:
            continue
    return [p for p in found.values() if _alive(p)]


def stop_processes(find: Callable[[], list[psutil.Process]], grace_s: float = 2.0) -> list[psutil.Process]:
    """SIGTERM what `find()` returns, then, after `grace_s`, SIGKILL what it still returns until it
    returns nothing (a raylet can fork a worker after the list was taken), for up to 30 s; returns
    what is left. The grace is short: a test's cluster is thrown away, and a GCS server ignores
    SIGTERM (a longer wait only ever ended in the SIGKILL, 15 s later)."""
    procs = find()
    for p in procs:
        _signal(p, signal.SIGTERM)
    psutil.wait_procs(procs, timeout=grace_s)
    deadline = time.monotonic() + 30
    while (alive := find()) and time.monotonic() < deadline:
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)
    return find()


class RayNodes:
    """A head and named workers on loopback: the cluster's ports are `base_port` (the GCS), the next
    (the dashboard), and a block of 50 per node from `base_port` + 10 (three nodes: up to + 159)."""

    def __init__(self, base_port: int, system_config: dict[str, Any] | None = None,
                 redis_address: str | None = None) -> None:
        """`redis_address` (host:port): the head's GCS keeps its state there (GCS fault tolerance),
        so a head started again after `kill("head")` takes the cluster back, workers and actors
        included."""
        self.base_port = base_port
        self.redis_address = redis_address
        self.gcs_port, self.dashboard_port = base_port, base_port + 1
        self.system_config = system_config or {}
        self.nodes: dict[str, Node] = {}
        self.started_at = time.time()
        # Token authentication, as the deployment guide sets it up: every node and every call to
        # the dashboard carries the cluster's token (never the caller's ~/.ray one).
        self.token = secrets.token_hex(32)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self) -> dict[str, str]:
        """The nodes' environment: this project's Serve settings, none of the caller's RAY_ ones."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return env | SERVING_ENV | {"PATH": f"{BIN}:{env['PATH']}", "PYTHONPATH": str(REPO),
                                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                                    # Serve gives its proxy 3 x 5 s to start; three nodes starting on two
                                    # cores can take longer (seen: the controller killed the proxy
                                    # before its process ran, and the deploy failed).
                                    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def add(self, name: str, resources: dict[str, float], num_cpus: float = 1, head: bool = False) -> Node:
        """Describe a node (the head first) and start it."""
        index = len(self.nodes)
        # Ray's temp dir stays short: its socket paths must fit AF_UNIX's 107 bytes.
        temp_dir = Path(tempfile.mkdtemp(prefix=f"qkv-ray-{name}-", dir="/tmp"))
        # Each node's block of 50 ports: metrics, node manager, agent, client server, then 40 for
        # its worker processes (a narrower range ran out: "No available ports").
        ports = self.base_port + 10 + index * 50
        head_flags = []
        if head:
            assert not self.nodes, "the head is added first"
            head_flags = ["--head", f"--port={self.gcs_port}", "--include-dashboard=true",
                          "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                          f"--dashboard-agent-listen-port={ports + 2}", f"--ray-client-server-port={ports + 3}",
                          f"--system-config={json.dumps(self.system_config)}"]
        node = Node(name, temp_dir, resources, num_cpus, metrics_port=ports, node_manager_port=ports + 1,
                    worker_ports=(ports + 10, ports + 49), head_flags=head_flags,
                    client_server_port=ports + 3 if head else None)
        self.nodes[name] = node
        self.start(name)
        return node

    def start(self, name: str) -> None:
        """`ray start` the node (again, after `kill`)."""
        node = self.nodes[name]
        cmd = [str(BIN / "ray"), "start", *node.head_flags, f"--temp-dir={node.temp_dir}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={node.num_cpus}", f"--resources={json.dumps(node.resources)}",
               "--object-store-memory=100000000", f"--metrics-export-port={node.metrics_port}",
               f"--node-manager-port={node.node_manager_port}",
               f"--min-worker-port={node.worker_ports[0]}", f"--max-worker-port={node.worker_ports[1]}"]
        if not node.is_head:
            cmd += [f"--address=127.0.0.1:{self.gcs_port}", f"--dashboard-agent-listen-port={node.metrics_port + 2}"]
        env = self.env()
        if node.is_head:
            # `ray start --head` refuses a port that the address file of its temp dir names while any
            # local process still names that address: after `kill("head")`, the workers' raylets do.
            (node.temp_dir / "ray_current_cluster").unlink(missing_ok=True)
        if self.redis_address is not None:
            # Workers wait this long for a lost GCS before they give up (Ray's default: 60 s).
            env["RAY_gcs_rpc_server_reconnect_timeout_s"] = "120"
            if node.is_head:
                env |= {"RAY_REDIS_ADDRESS": self.redis_address,
                        "RAY_external_storage_namespace": f"qkv-test-{self.base_port}"}
        done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if node.is_head:
            wait_until(lambda: answers(f"{self.dashboard}/api/version"), 90, f"the head's dashboard ({node.temp_dir})")

    def kill(self, name: str) -> tuple[int, float]:
        """SIGKILL every process of the node at once (a machine gone); returns how many, and the
        time.time() by which all were signalled (finding them takes a moment: a request sent in
        that moment may still have reached the node)."""
        procs = self.nodes[name].processes()
        for p in procs:
            _signal(p, signal.SIGKILL)
        signalled = time.time()
        psutil.wait_procs(procs, timeout=15)
        return len(procs), signalled

    def node_by_pid(self) -> dict[int, str]:
        """Every live process of the cluster -> the name of its node (one scan per node)."""
        return {p.pid: name for name, node in self.nodes.items() for p in node.processes()}

    def deploy(self, config: dict[str, Any]) -> None:
        """Deploy a Serve config (what `serve deploy` sends to the dashboard)."""
        r = requests.put(f"{self.dashboard}/api/serve/applications/", json=config, headers=self.headers,
                         timeout=240)
        assert r.status_code == 200, r.text[:2000]

    def serve_details(self) -> dict[str, Any]:
        r = requests.get(f"{self.dashboard}/api/serve/applications/", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def replicas(self, app: str, deployment: str) -> list[dict[str, Any]]:
        """The deployment's replicas as Serve's details list them (state, pid, node_id, ...)."""
        try:
            details = self.serve_details()
        except requests.RequestException:
            return []
        apps = details.get("applications") or {}
        dep = ((apps.get(app) or {}).get("deployments") or {}).get(deployment) or {}
        return list(dep.get("replicas") or [])

    def app_status(self, app: str) -> str:
        """The app's status and message, and its deployments' replica states (for failure messages)."""
        try:
            details = (self.serve_details().get("applications") or {}).get(app) or {}
        except requests.RequestException as exc:
            return f"dashboard: {exc}"
        states = {name: [r.get("state") for r in dep.get("replicas") or []]
                  for name, dep in (details.get("deployments") or {}).items()}
        return f"{details.get('status')} {details.get('message', '')[:1500]} {states}"

    def stop(self) -> None:
        """Stop every node's processes (SIGTERM, then SIGKILL), HAProxy left by Serve, temp dirs.
        Raises when a process of the cluster survives."""
        stop_processes(lambda: [p for node in self.nodes.values() for p in node.processes()])
        reap_orphaned_haproxy(self.started_at)  # a HAProxy whose Ray is gone holds Serve's ports
        left = [p for node in self.nodes.values() for p in node.processes()]
        for node in self.nodes.values():
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's Ray still running: {left}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def answers(url: str) -> bool:
    """The server is up (any HTTP answer: a dashboard answers 401 without the token)."""
    try:
        requests.get(url, timeout=5)
        return True
    except requests.RequestException:
        return False


# A serving cluster: the head (Serve's controller, HAProxy, the KV index) and workers a and b, each
# holding one engine replica (a custom resource places them). The prefix router runs on every node
# with an engine replica (Serve places it per node); the KV index is pinned to the head so that it
# outlives a worker.
WORKERS = ("a", "b")


def serving_config(model: Path, http_port: int, per_worker: int = 1, kv_cache_index: bool = True,
                   app_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """`per_worker` engine replicas on each worker; `kv_cache_index` off: the router goes by its own
    record of where it sent prefixes; `app_args` add to (or replace) the app's arguments."""
    args = {"model": str(model), "num_replicas": per_worker * len(WORKERS), "max_num_seqs": 8, "block_size": 16,
            "engine_num_cpus": 0.5, "router_num_cpus": 0.1, "torch_threads": 1, "kv_cache_index": kv_cache_index,
            **(app_args or {})}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{
                "name": "qkv", "route_prefix": "/", "import_path": "service.app:build_app", "args": args,
                "deployments": [
                    {"name": "EngineDeployment",
                     "ray_actor_options": {"num_cpus": 0.5, "resources": {"qkv_engine_slot": 1}}},
                    *([{"name": "KVIndex", "ray_actor_options": {"num_cpus": 0, "resources": {"qkv_head": 0.1}}}]
                      if kv_cache_index else []),
                ]}]}


def start_serving_cluster(model: Path, base_port: int, http_port: int, per_worker: int = 1,
                          kv_cache_index: bool = True, app_args: dict[str, Any] | None = None,
                          redis_address: str | None = None) -> RayNodes:
    """Start the nodes, deploy, and wait until HAProxy serves a completion; stopped again on failure.
    `redis_address`: the head's GCS keeps its state there (GCS fault tolerance)."""
    nodes = RayNodes(base_port, system_config={"metrics_report_interval_ms": 1000}, redis_address=redis_address)
    try:
        # Two logical CPUs per node: a raylet starts at most that many worker processes at once
        # (one would queue the head's controller, proxy, router and index behind each other).
        nodes.add("head", {"qkv_head": 1}, num_cpus=2, head=True)
        for name in WORKERS:
            nodes.add(name, {"qkv_engine_slot": per_worker}, num_cpus=2)
        nodes.deploy(serving_config(model, http_port, per_worker, kv_cache_index, app_args))
        want = {w: per_worker for w in WORKERS}
        try:
            wait_until(lambda: engines_running(nodes) == want, 300, f"engine replicas running: {want}", every_s=2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the app: {nodes.app_status('qkv')}") from None
        wait_until(lambda: _completes(f"http://127.0.0.1:{http_port}"), 120, "HAProxy to serve a completion")
    except BaseException:
        nodes.stop()
        raise
    return nodes


def engines_running(nodes: RayNodes) -> dict[str, int]:
    """Node name -> how many engine replicas are RUNNING there (found by their processes)."""
    running = [r["pid"] for r in nodes.replicas("qkv", "EngineDeployment") if r.get("state") == "RUNNING" and r.get("pid")]
    found: dict[str, int] = {}
    if running:
        where = nodes.node_by_pid()
        # a replica of a node just killed, not yet known dead, has no live process: not counted
        for node in filter(None, map(where.get, running)):
            found[node] = found.get(node, 0) + 1
    return found


def replica_urls(nodes: RayNodes) -> dict[str, str]:
    """Node name -> the base URL of the HTTP edge of the engine replica running there (one per
    worker): the replica process's listening port that answers `/v1/models`. A request sent there
    skips HAProxy and the router, as a test that wants a given replica must."""
    where = nodes.node_by_pid()
    urls: dict[str, str] = {}
    for replica in nodes.replicas("qkv", "EngineDeployment"):
        node = where.get(replica.get("pid"))
        if replica.get("state") != "RUNNING" or node is None:
            continue
        ports = sorted({c.laddr.port for c in psutil.Process(replica["pid"]).net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN})
        for port in ports:
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).ok:
                    urls[node] = f"http://127.0.0.1:{port}"
                    break
            except requests.RequestException:
                continue
    return urls


def index_replicas(nodes: RayNodes) -> float | None:
    """How many replicas the KV index holds (its gauge on the head's metrics endpoint); None before
    it is exported."""
    from tests.support.serve_fixtures import scrape

    try:
        samples = scrape(f"http://127.0.0.1:{nodes.nodes['head'].metrics_port}/metrics")
    except requests.RequestException:
        return None
    found = [v for n, _, v in samples if n == "ray_qkv_kv_index_replicas"]
    return found[0] if found else None


def _completes(url: str) -> bool:
    try:
        return requests.post(f"{url}/v1/completions", json={"prompt": "probe", "max_tokens": 2}, timeout=30).ok
    except requests.RequestException:
        return False
