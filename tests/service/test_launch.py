"""service/launch.py: the serving path's settings, and the launcher's clean-up of a HAProxy that
outlived its Ray (seen after a Ctrl-C of `make serve` under load: it kept port 8000 and HAProxy's
fixed stats ports, so no later Serve on the machine could start)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.launch import haproxy_binary, orphaned_haproxy, reap_orphaned_haproxy, running
from tests.support.polling import wait_until

HAPROXY_CONFIG = """global
    maxconn 16
defaults
    mode http
    timeout connect 1s
    timeout client 1s
    timeout server 1s
frontend probe
    bind 127.0.0.1:{port}
    http-request return status 200
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _orphaned_haproxy(tmp_path: Path) -> int:
    """This environment's HAProxy, started by a shell that exits at once: reparented to init, as
    the one Ray left was. Returns its PID."""
    binary = haproxy_binary()
    if binary is None or not os.access(binary, os.X_OK):
        pytest.fail(f"Ray Serve's HAProxy is not installed in this environment ({binary})")
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=_free_port()))
    pid_file = tmp_path / "pid"
    subprocess.run(["bash", "-c", f"'{binary}' -db -f '{config}' >/dev/null 2>&1 & echo $! > '{pid_file}'"],
                   check=True, timeout=30)
    pid = int(pid_file.read_text())
    wait_until(lambda: pid in orphaned_haproxy(time.time() - 60), 30, "the HAProxy to be reparented to init")
    return pid


def test_an_orphaned_haproxy_of_this_environment_is_stopped_and_nothing_else(tmp_path: Path) -> None:
    since = time.time()
    pid = _orphaned_haproxy(tmp_path)
    assert orphaned_haproxy(time.time() + 60) == []  # only those started after `since`
    assert reap_orphaned_haproxy(since) == [pid]
    assert not running(pid) and orphaned_haproxy(since) == []


def test_the_launcher_returns_its_commands_status_and_stops_what_it_left(tmp_path: Path) -> None:
    """`python -m service.launch CMD`: CMD's exit status, and a HAProxy CMD left behind stopped."""
    binary = haproxy_binary()
    config = tmp_path / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=_free_port()))
    script = f"'{binary}' -db -f '{config}' >/dev/null 2>&1 & echo $! > '{tmp_path / 'pid'}'; exit 3"
    run = subprocess.run([sys.executable, "-m", "service.launch", "bash", "-c", script], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 3, run.stderr
    pid = int((tmp_path / "pid").read_text())
    assert f"stopped 1 HAProxy process(es) Ray Serve left running: [{pid}]" in run.stderr
    wait_until(lambda: not running(pid), 10, "the stopped HAProxy to be reaped")
