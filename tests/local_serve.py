"""Start the service on this machine for tests and benchmarks, and stop it again (test
scaffolding: not part of the installed package; loadtests/ import it from here).

A fresh local Ray instance on loopback, Serve's HTTP proxy on a chosen port, the application
from `service.app.compose_app`; everything is shut down on exit, whatever happened.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray
from ray import serve

import fault_injection
from service.app import AppArgs, compose_app

logger = logging.getLogger(__name__)


@contextmanager
def local_service(args: dict[str, Any], http_port: int, num_cpus: float = 2,
                  metrics_port: int | None = None, metrics_interval_ms: int = 1000,
                  step_fault_marker: str | None = None, step_stall_marker: str | None = None) -> Iterator[str]:
    """Run the application for `args` on a new local Ray (never an existing cluster); yields
    the base URL.

    With `metrics_port`, Ray's Prometheus endpoint is http://127.0.0.1:<metrics_port>/metrics and
    metrics are reported every `metrics_interval_ms` (Ray's private settings: fine in tests).
    With `step_fault_marker`, a prompt containing it makes the engine step raise
    (`fault_injection.StepFaultInjector`); with `step_stall_marker`, such a prompt makes the step
    hang (`fault_injection.StepStallInjector`). Both may be given.
    """
    init: dict[str, Any] = {"address": "local", "num_cpus": num_cpus, "include_dashboard": False,
                            "_node_ip_address": "127.0.0.1", "logging_level": logging.WARNING}
    if metrics_port is not None:
        init["_metrics_export_port"] = metrics_port
        init["_system_config"] = {"metrics_report_interval_ms": metrics_interval_ms}
    wrapper = None
    if step_fault_marker or step_stall_marker:
        # The replica cannot import tests/: ship the injectors' code inside the pickle.
        ray.cloudpickle.register_pickle_by_value(fault_injection)
        wrapper = functools.partial(fault_injection.inject, fault_marker=step_fault_marker, stall_marker=step_stall_marker)
    ray.init(**init)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(compose_app(AppArgs.model_validate(args), engine_wrapper=wrapper), name="qkv", route_prefix="/")
        yield f"http://127.0.0.1:{http_port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


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
