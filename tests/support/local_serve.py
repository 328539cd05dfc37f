"""Start the service on this machine for tests and benchmarks, and stop it again (test
scaffolding: not part of the installed package; loadtests/ import it from here).

`local_service`: a fresh local Ray instance on loopback, Serve's HTTP proxy on a chosen port, the
application from `service.app.compose_app`; everything is shut down on exit, whatever happened.

`shared_service`: the same application deployed on one local Ray + Serve that the whole test
session shares (started on first use, stopped by tests/conftest.py at the end of the session):
each test module deploys its own app and deletes it when done, which saves the 10-15 s of Ray and
Serve start-up and shutdown per module. Modules that need their own Ray settings (a metrics port,
the dashboard, a multi-node cluster) use `local_service` or their own set-up, which stop the shared
instance first.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import ray
from ray import serve

from tests.support import fault_injection
from service.app import AppArgs, compose_app
from service.launch import reap_orphaned_haproxy

logger = logging.getLogger(__name__)

APP_NAME = "qkv"
# What the `shared_serve` fixture (tests/conftest.py) gives a module: `shared_service`.
SharedServe = Callable[..., AbstractContextManager[str]]
SHARED_HTTP_PORT = 18390
SHARED_NUM_CPUS = 2
# Replica actors of the app: none may outlive the module that deployed it.
_REPLICA_PREFIX = f"SERVE_REPLICA::{APP_NAME}#"
_shared: dict[str, str] = {}  # "url" while the shared Ray + Serve runs
_ray_started: dict[str, float] = {}  # "at": when this process last started its own Ray (time.time())


@contextmanager
def local_service(args: dict[str, Any], http_port: int, num_cpus: float = 2,
                  metrics_port: int | None = None, metrics_interval_ms: int = 1000,
                  step_fault_marker: str | None = None, step_stall_marker: str | None = None,
                  step_gate: str | None = None) -> Iterator[str]:
    """Run the application for `args` on a new local Ray (never an existing cluster); yields
    the base URL.

    With `metrics_port`, Ray's Prometheus endpoint is http://127.0.0.1:<metrics_port>/metrics and
    metrics are reported every `metrics_interval_ms` (Ray's private settings: fine in tests).
    With `step_fault_marker`, a prompt containing it makes the engine step raise
    (`fault_injection.StepFaultInjector`); with `step_stall_marker`, such a prompt makes the step
    hang (`fault_injection.StepStallInjector`). With `step_gate`, the engine computes nothing while
    that file exists (`fault_injection.StepGate`). Any of them may be given.
    """
    stop_shared_service()  # one Ray per process: this one is the caller's own
    wrapper = _engine_wrapper(step_fault_marker, step_stall_marker, step_gate=step_gate)
    _start_ray_and_serve(http_port, num_cpus, metrics_port, metrics_interval_ms)
    try:
        serve.run(compose_app(AppArgs.model_validate(args), engine_wrapper=wrapper), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{http_port}"
    finally:
        _stop_ray_and_serve()


@contextmanager
def shared_service(args: dict[str, Any], step_fault_marker: str | None = None,
                   step_stall_marker: str | None = None, slow_export_marker: str | None = None,
                   slow_export_s: float = 5.0, slow_export_started: str | None = None) -> Iterator[str]:
    """Deploy the application for `args` as app "qkv" on the session's shared local Ray + Serve
    (`SHARED_NUM_CPUS` CPUs, no dashboard, no metrics port; started here on first use); yields the
    base URL. On exit the app is deleted and its replicas are gone, whatever happened, so the next
    module starts from an empty Serve. The fault markers are those of `local_service`; with
    `slow_export_marker`, a prefill replica exporting such a prompt's blocks sleeps `slow_export_s`
    first, creating the file `slow_export_started` as it begins (`fault_injection.SlowExport`)."""
    wrapper = _engine_wrapper(step_fault_marker, step_stall_marker, slow_export_marker, slow_export_s,
                              slow_export_started)
    if not _shared:
        _start_ray_and_serve(SHARED_HTTP_PORT, SHARED_NUM_CPUS, None, 0)
        _shared["url"] = f"http://127.0.0.1:{SHARED_HTTP_PORT}"
    try:
        # What a module left behind would leak into this one: refuse to start on it.
        assert not serve.status().applications, f"Serve still runs {sorted(serve.status().applications)}"
        assert not _replica_actors(), f"replicas of an earlier app are alive: {_replica_actors()}"
        serve.run(compose_app(AppArgs.model_validate(args), engine_wrapper=wrapper), name=APP_NAME, route_prefix="/")
        yield _shared["url"]
    finally:
        _delete_app_or_stop()


def stop_shared_service() -> None:
    """Stop the shared Ray + Serve if it runs (the end of the session, or a caller that needs
    its own Ray)."""
    if _shared:
        _shared.clear()
        _stop_ray_and_serve()


def _delete_app_or_stop() -> None:
    """Delete the app and wait until its replica actors are gone; if Serve cannot do that, stop
    the shared instance so that the next module gets a fresh one."""
    try:
        serve.delete(APP_NAME)  # blocks until the app is gone
        _wait(lambda: not _replica_actors(), 60, "the deleted app's replicas to exit")
    except Exception:
        logger.exception("deleting the app failed: stopping the shared Ray")
        stop_shared_service()


def _replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(_REPLICA_PREFIX)]


def _wait(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def _engine_wrapper(step_fault_marker: str | None, step_stall_marker: str | None,
                    slow_export_marker: str | None = None, slow_export_s: float = 5.0,
                    slow_export_started: str | None = None, step_gate: str | None = None) -> Any:
    if not (step_fault_marker or step_stall_marker or slow_export_marker or step_gate):
        return None
    # The replica cannot import tests/: ship the injectors' code inside the pickle.
    ray.cloudpickle.register_pickle_by_value(fault_injection)
    return functools.partial(fault_injection.inject, fault_marker=step_fault_marker, stall_marker=step_stall_marker,
                             slow_export_marker=slow_export_marker, slow_export_s=slow_export_s,
                             slow_export_started=slow_export_started, step_gate=step_gate)


def _start_ray_and_serve(http_port: int, num_cpus: float, metrics_port: int | None, metrics_interval_ms: int) -> None:
    init: dict[str, Any] = {"address": "local", "num_cpus": num_cpus, "include_dashboard": False,
                            "_node_ip_address": "127.0.0.1", "logging_level": logging.WARNING}
    if metrics_port is not None:
        init["_metrics_export_port"] = metrics_port
        init["_system_config"] = {"metrics_report_interval_ms": metrics_interval_ms}
    _ray_started["at"] = time.time()
    ray.init(**init)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    except BaseException:
        ray.shutdown()
        reap_orphaned_haproxy(_ray_started["at"])
        raise


def _stop_ray_and_serve() -> None:
    """Shut Serve and Ray down, then stop a HAProxy Ray left running (service/launch.py says when
    that happens): it would hold the fixed ports every later Serve on the machine needs."""
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        reap_orphaned_haproxy(_ray_started.get("at", time.time()))


def write_tiny_checkpoint(path: str | Path, max_position: int = 256, **config: Any) -> Path:
    """A small random-weight model directory (byte tokenizer): fast enough for tests on a CPU."""
    from model.config import ModelConfig
    from model.loading.checkpoint import save_model
    from model.models.transformer import Transformer

    cfg = ModelConfig(**({"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_position": max_position}
                         | config))
    net = Transformer(cfg)
    net.init_weights(cfg.init_seed)
    save_model(net, path)
    return Path(path)
