"""Every test process serves the way `make serve` does: `service.launch.SERVING_ENV` (HAProxy
in front of each engine replica's own port) is set before anything imports Ray Serve, whose
settings are read from the environment at import time, in this process and in the Ray it starts.
"""

import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.launch import apply_serving_env

apply_serving_env()
# Tests stop replicas often (redeploys, teardown): HAProxy drops a stopped replica within a
# second or two here, so the drain's floor need not be Ray's 30 s production default.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")

SHARED_SERVE = "shared_serve"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--accel-device", default="cuda",
                     help="the device of the tests marked gpu (tests/gpu/test_gpu.py, `pytest -m gpu`); "
                          "`--accel-device cpu` runs them on the CPU to check the tests themselves")


def runs_gpu_tests(config: pytest.Config) -> bool:
    """Whether this run selects the gpu-marked tests (`-m gpu`, `-m "gpu and not slow"`, ...)."""
    expr = (config.getoption("markexpr") or "").replace("(", " ").replace(")", " ").split()
    return any(word == "gpu" and (i == 0 or expr[i - 1] != "not") for i, word in enumerate(expr))


def pytest_configure(config: pytest.Config) -> None:
    """Outside a gpu run, CUDA is hidden (before anything initialises it): the rest of the suite
    is the CPU's (the fused kernels, `device="auto"` meaning the CPU), also on a GPU machine."""
    if not runs_gpu_tests(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def shared_serve() -> Iterator[Callable[..., Any]]:
    """`local_serve.shared_service`: deploy a module's app on the Ray + Serve the session shares
    (see tests/support/local_serve.py); the shared instance is stopped when the session ends."""
    from tests.support import local_serve
    yield local_serve.shared_service
    local_serve.stop_shared_service()


# The test modules that start servers (Ray, Serve, a Ray cluster, HAProxy, Prometheus, Redis, a
# browser) run one after another on one pytest-xdist worker (`make test` runs two): they pick
# fixed loopback ports, and two at once would take each other's. The other modules (in process:
# the model, the service's parts, the docs) run on the other worker meanwhile, each module whole
# on one worker. The grouping is a scheduler of our own: xdist 3.8's `loadgroup` tags a group by
# rewriting `item._nodeid`, which pytest 9.2 no longer reads, so its groups were ignored. The
# scheduler sees node ids only, so a module is told by its path and its text.
APART = "servers"
_STARTS_SERVERS = re.compile(rf"pytest\.mark\.slow|{SHARED_SERVE}|ray\.init\(|local_service\(|serve_on_local_ray\("
                             r"|start_serving_cluster\(|RayNodes\(")


@functools.cache
def module_starts_servers(path: Path) -> bool:
    """Whether a test module starts servers: it lives in tests/e2e, has a test marked slow, asks
    for the shared Serve, or starts a Ray of its own."""
    return "e2e" in path.parts or bool(_STARTS_SERVERS.search(path.read_text()))


# optionalhook: the hook is xdist's, unknown to a pytest without it
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with two kinds of scope: `APART` (every module that starts
    servers) and each other module. Scopes go out largest first (in the whole suite `APART` is the
    largest, so it starts at once), and a worker gets the next scope only when it has two tests
    or fewer left, so the other modules all go to the other worker meanwhile."""
    if config.getvalue("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServersApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return APART if module_starts_servers(config.rootpath / module) else module

    return ServersApart(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules on the shared Ray + Serve (any of whose tests asks for `shared_serve`) run
    last, one after another: the shared instance starts once, no module with its own Ray has to
    stop it, and no other test runs beside its idle processes. Modules move whole; the order
    within each group is the one the run had (pytest's, or a random-order plugin's: trylast, so
    a shuffle is done before this split and cannot undo it)."""
    on_shared = {item.path for item in items if SHARED_SERVE in getattr(item, "fixturenames", ())}
    rest = [item for item in items if item.path not in on_shared]
    items[:] = rest + [item for item in items if item.path in on_shared]


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
