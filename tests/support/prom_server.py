"""A real Prometheus server for tests: deploy/prometheus.yml made fast and pointed at one Ray
session, a temporary storage directory, a loopback port, and its HTTP query API."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.support import child
from tests.support.serve_fixtures import REPO, wait_until

logger = logging.getLogger(__name__)

DEPLOY_CONFIG = REPO / "deploy" / "prometheus.yml"
SD_FILE = "prom_metrics_service_discovery.json"


def config_for_session(session_dir: Path, scrape_interval_s: int) -> dict[str, Any]:
    """deploy/prometheus.yml with a 1 s scrape interval, reading the discovery file of
    `session_dir` (not the /tmp/ray symlink, which another Ray on this machine may own)."""
    config = yaml.safe_load(DEPLOY_CONFIG.read_text())
    config["global"]["scrape_interval"] = f"{scrape_interval_s}s"
    config["global"]["evaluation_interval"] = f"{scrape_interval_s}s"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "ray"]
    (sd,) = job["file_sd_configs"]
    assert sd["files"] == ["/tmp/ray/" + SD_FILE], sd
    sd["files"] = [str(session_dir / SD_FILE)]
    sd["refresh_interval"] = f"{scrape_interval_s}s"
    return config


def promtool_check(config_file: Path) -> subprocess.CompletedProcess[str]:
    """`promtool check config` on `config_file`."""
    return subprocess.run(["promtool", "check", "config", str(config_file)], capture_output=True,
                          text=True, check=False, timeout=60)


class PrometheusServer:
    """`prometheus` on 127.0.0.1:`port` with `config`; use as a context manager."""

    def __init__(self, config: dict[str, Any], workdir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.config_file = workdir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.storage = workdir / "tsdb"
        self.log_file = workdir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> "PrometheusServer":
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (.ci/run installs Debian's package)"
        with self.log_file.open("wb") as log:
            self._proc = subprocess.Popen(
                [binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.storage}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, 60, "prometheus /-/ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        if self._proc is None:
            return
        child.stop(self._proc)
        self._proc = None

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self._proc.returncode}:\n{self.log_file.read_text()}")
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; the result vector (raises on a PromQL or server error)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        resp = requests.get(f"{self.url}/api/v1/query", params=params, timeout=10)
        body = resp.json()
        if body.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The value of a query that yields one series; None when it yields none."""
        result = self.query(expr, at)
        if not result:
            return None
        assert len(result) == 1, f"{expr!r} returned {len(result)} series"
        return float(result[0]["value"][1])

    def active_targets(self) -> list[dict[str, Any]]:
        return requests.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]

    def wait_for(self, expr: str, expected: float, timeout_s: float = 60) -> float:
        """Poll until `expr` equals `expected` (counters settle as Ray reports and we scrape)."""
        return wait_until(lambda: v if (v := self.scalar(expr)) == expected else None, timeout_s,
                          f"{expr} == {expected}")
