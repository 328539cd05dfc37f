"""A Redis server for a test (Debian's `redis-server`, which .ci/run installs): on 127.0.0.1 at a
given port, keeping nothing on disk, stopped on exit. It stores the GCS state of a Ray head with
fault tolerance (tests/e2e/test_head_restart.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from tests.support import child
from tests.support.polling import wait_until


class RedisServer:
    """`redis-server` on 127.0.0.1:`port`; use as a context manager. `address` is host:port."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RedisServer:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed (.ci/run installs Debian's package)"
        with (self.workdir / "redis.log").open("wb") as log:
            # No snapshots and no append-only file: the server lives as long as the test.
            self._proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                           "--appendonly", "no", "--dir", str(self.workdir)],
                                          stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self.answers, 30, f"redis-server on {self.address}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def answers(self) -> bool:
        """PING answered with PONG."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __exit__(self, *_: Any) -> None:
        if self._proc is None:
            return
        child.stop(self._proc)
        self._proc = None
