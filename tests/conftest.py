"""Every test process serves the way `make serve` does: `service.launch.SERVING_ENV` (HAProxy
in front of each engine replica's own port) is set before anything imports Ray Serve, whose
settings are read from the environment at import time, in this process and in the Ray it starts.
"""

import os
import sys

import pytest

from service.launch import apply_serving_env

apply_serving_env()
# Tests stop replicas often (redeploys, teardown): HAProxy drops a stopped replica within a
# second or two here, so the drain's floor need not be Ray's 30 s production default.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")

# The exit status pytest reports, kept for `pytest_unconfigure`.
_SESSION: dict[str, int] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _SESSION["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave with pytest's own exit status once every plugin has finished, skipping the
    interpreter's teardown: on 1 Dec a fresh-clone CI run passed every test (756) and then the
    process died with SIGSEGV while the interpreter tore down its C extensions (torch, tokenizers,
    xgrammar and the clients' libraries loaded in one process), which made `make test` fail. The
    crash is after the last test and did not reproduce in shorter runs; the tests' results are
    not touched by this, only that teardown. Ray clusters the tests start are shut down by their
    fixtures before this runs."""
    if "exitstatus" in _SESSION:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION["exitstatus"])
