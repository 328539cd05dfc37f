"""A server a test started as a child process (redis-server, prometheus): stopped the same way."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if it has not exited within 20 s; returns once it is gone."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
