"""Fault injection for the end-to-end tests (never shipped: it lives under tests/).

`StepFaultInjector` wraps an `Engine`: once a request whose prompt text contains the marker is
added, the next `step()` raises. It lets a test exercise what a real step failure (a CUDA error,
a bug) does to the service: every request in the batch gets an error, `/health` turns 503,
Serve replaces the replica. `tests/support/local_serve.py` hands it to the engine replica as an
`engine_wrapper`, a Python callable that no config file can set.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from model.engine.sequence import RequestOutput
from model.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


class StepFaultInjector:
    """Wraps an `Engine`: once a request whose prompt text contains `marker` is added, the
    next `step()` raises. Everything else is passed through to the engine."""

    def __init__(self, engine: Any, marker: str) -> None:
        if not marker:
            raise ValueError("the fault marker must not be empty")
        self._engine = engine
        self._marker = marker
        self._marked: set[str] = set()
        logger.warning("TEST fault injection is on: a prompt containing %r makes the engine step raise", marker)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._engine.add_request(request_id, prompt_token_ids, params)
        if self._marker in self._engine.tokenizer.decode(prompt_token_ids):
            self._marked.add(request_id)

    def step(self) -> list[RequestOutput]:
        if self._marked:
            raise RuntimeError(f"injected fault: request {sorted(self._marked)[0]} carries the fault marker")
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:  # runtime, stats, abort_request, has_unfinished, ...
        return getattr(self._engine, name)


class StepStallInjector(StepFaultInjector):
    """Wraps an `Engine`: once a request whose prompt text contains `marker` is added, the next
    `step()` never returns (a wedged kernel): the loop thread lives on but makes no progress."""

    def step(self) -> list[RequestOutput]:
        if self._marked:
            logger.warning("injected stall: request %s carries the stall marker", sorted(self._marked)[0])
            while True:
                time.sleep(1.0)
        return self._engine.step()


class StepGate:
    """Wraps an `Engine`: while the file `path` exists, `step()` computes nothing (the loop still
    takes new requests and aborts between its calls), so a test can have a whole burst held by the
    engine before its first token, known by the engine's state rather than by timing; deleting
    the file lets the steps run."""

    def __init__(self, engine: Any, path: str) -> None:
        self._engine, self._path = engine, path

    def step(self) -> list[RequestOutput]:
        if os.path.exists(self._path):
            time.sleep(0.05)
            return []
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class SlowExport:
    """Wraps an `Engine`: exporting the blocks of a prompt whose text contains `marker` (a prefill
    replica's side of a transfer) first sleeps `delay_s` on the step thread, long enough for a test
    to kill the replica mid-transfer; with `started`, that file is created as the sleep begins (the
    replica runs on the test's machine), so the test waits for it instead of guessing when."""

    def __init__(self, engine: Any, marker: str, delay_s: float, started: str | None = None) -> None:
        self._engine, self._marker, self._delay_s, self._started = engine, marker, delay_s, started

    def export_prefix(self, prompt_token_ids: list[int], lora: str | None = None) -> Any:
        if self._marker in self._engine.tokenizer.decode(prompt_token_ids):
            logger.warning("injected delay: exporting a prompt with the marker after %.0f s", self._delay_s)
            if self._started is not None:
                Path(self._started).touch()
            time.sleep(self._delay_s)
        return self._engine.export_prefix(prompt_token_ids, lora)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def inject(engine: Any, fault_marker: str | None = None, stall_marker: str | None = None,
           slow_export_marker: str | None = None, slow_export_s: float = 5.0,
           slow_export_started: str | None = None, step_gate: str | None = None) -> Any:
    """The engine wrapped by the injectors whose markers (or gate file) are given (an `engine_wrapper`)."""
    if fault_marker:
        engine = StepFaultInjector(engine, fault_marker)
    if stall_marker:
        engine = StepStallInjector(engine, stall_marker)
    if slow_export_marker:
        engine = SlowExport(engine, slow_export_marker, slow_export_s, slow_export_started)
    if step_gate:
        engine = StepGate(engine, step_gate)
    return engine
