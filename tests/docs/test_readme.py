"""The README as a newcomer uses it: at most 150 lines, and its commands work as written.

`make serve` is run from the README's "Set up" block, then the "First requests" section's curl
block (with bash) and its Python block (with this venv's Python, the official `openai` client)
are run against it unchanged. Not run: `make test` (this is it), the GPU install (needs a CUDA
build) and the hub model (needs the network); tests/docs/test_docs_sources.py checks that their
argument names exist.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support.requirements import in_ci
from tests.support.serve_fixtures import wait_until
from tests.support.paths import REPO

README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)
URL = "http://127.0.0.1:8000"


def section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(?P<body>.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README has no section '## {title}'"
    return match["body"]


def blocks(title: str, lang: str) -> list[str]:
    return [b["body"] for b in FENCE.finditer(section(title)) if b["lang"] == lang]


def test_the_readme_is_short_and_links_into_the_docs() -> None:
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README)
    assert len(links) >= 15
    missing = sorted({link for link in links if not (REPO / link).is_file()})
    assert not missing, f"README links to missing pages: {missing}"


def serve_command() -> str:
    commands = [line.split("#")[0].strip() for block in blocks("Set up", "bash") for line in block.splitlines()]
    assert "make serve" in commands and "make test" in commands, commands
    return "make serve"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_the_readme_commands_work_as_written(tmp_path: Path) -> None:
    if not port_free(8000):
        if in_ci():
            pytest.fail("port 8000 is taken: the README's `make serve` serves there")
        pytest.skip("port 8000 is taken (a service of your own?): the README's `make serve` serves there")
    (curl,) = blocks("First requests", "bash")
    (client,) = blocks("First requests", "python")
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(serve_command(), shell=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        def ready() -> bool | None:
            assert server.poll() is None, f"make serve exited: {(tmp_path / 'serve.log').read_text()[-3000:]}"
            try:
                return requests.get(f"{URL}/v1/models", timeout=5).status_code == 200 or None
            except requests.RequestException:
                return None

        wait_until(ready, 300, "make serve to answer /v1/models", every_s=1)
        served = [m["id"] for m in requests.get(f"{URL}/v1/models", timeout=10).json()["data"]]
        assert "transformer-base-trained" in served  # the name the README's examples send

        out = subprocess.run(["bash", "-euo", "pipefail", "-c", curl], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["object"] == "text_completion" and body["choices"][0]["text"], body
        assert body["usage"]["completion_tokens"] == 16

        out = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "the openai client's stream printed nothing"
    finally:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C, as the README's user stops it
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()
    wait_until(lambda: port_free(8000), 30, "port 8000 to be free after Ctrl-C")
