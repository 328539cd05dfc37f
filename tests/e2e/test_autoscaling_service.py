"""The TTFT autoscaling policy on real Ray Serve (service/autoscaling.py): a load step on one
replica that serves one sequence at a time makes its first tokens slow; a second replica is added,
and once the load is over it is removed. A light stream of requests goes on all along, through the
scale-down: every request, of the load and of the light stream, gets a 200 and all its tokens.

What is checked is the order of events and the replica states Serve reports, never how long a
step took: the delays themselves ("not before the delay") are the policy's, tested on a fake clock
in tests/service/test_autoscaling_policy.py. The times are printed for the reader."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from ray import serve

from tests.support.local_serve import APP_NAME, local_service
from tests.support.serve_fixtures import health_status, send_completion, wait_until, write_tiny_model

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

HTTP_PORT = 18560
TARGET_TTFT_S = 0.2
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S, TTFT_WINDOW_S = 2.0, 4.0, 3.0
LOAD_CLIENTS, LOAD_TOKENS, TRICKLE_TOKENS = 8, 64, 16
# Hang bounds, far above the normal times: a decision showing in Serve's status (the replicas report
# every 0.5 s) plus, going up, a replica's start on a loaded 2-core machine (its Ray worker, torch,
# the engine), and going down its drain.
UP_SLACK_S, DOWN_SLACK_S = 120.0, 90.0


@dataclass
class Sent:
    start: float
    end: float
    error: str | None  # None: 200 with every token


class Traffic:
    """Clients in threads, each sending one request after another until stopped; every request is
    kept, failed or not."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None

    def start(self, clients: int, max_tokens: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=clients)
        for i in range(clients):
            self._pool.submit(self._client, f"{name} {i}: the quick brown fox jumps", max_tokens)

    def stop(self) -> float:
        """Stop sending and wait for the requests in flight; the time they were all done."""
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        return time.monotonic()

    def _client(self, prompt: str, max_tokens: int) -> None:
        n = 0
        while not self._stop.is_set():
            start, error = time.monotonic(), None
            try:
                send_completion(self.url, f"{prompt} #{n}", max_tokens, timeout_s=60)
            except Exception as exc:  # kept: the test reports every request that failed
                error = f"{type(exc).__name__}: {exc}"[:300]
            self.sent.append(Sent(start, time.monotonic(), error))
            n += 1


class ReplicaLog:
    """The engine deployment's replica states, polled from Serve's status in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                deployment = serve.status().applications[APP_NAME].deployments["EngineDeployment"]
            except Exception:  # a status call that failed: the next one counts
                logger.exception("could not read Serve's status")
            else:
                self.samples.append((time.monotonic(), {getattr(state, "value", state): n
                                                        for state, n in deployment.replica_states.items()}))
            time.sleep(0.2)

    def first(self, since: float, holds: Callable[[dict[str, int]], bool]) -> float | None:
        return next((t for t, states in self.samples if t >= since and holds(states)), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def running(states: dict[str, int]) -> int:
    return states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    args = {"model": str(model), "max_num_seqs": 1, "engine_num_cpus": 0.5, "torch_threads": 1,
            "router_num_cpus": 0.25, "graceful_shutdown_timeout_s": 30,
            # Serve's replicas push their reports every 0.5 s (its default is 10 s)
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 2.0,
                                   "metrics_interval_s": 0.5},
            "autoscaling_target_ttft_s": TARGET_TTFT_S, "autoscaling_target_queue": 100,  # on TTFT alone
            "autoscaling_upscale_delay_s": UPSCALE_DELAY_S, "autoscaling_downscale_delay_s": DOWNSCALE_DELAY_S,
            "autoscaling_ttft_window_s": TTFT_WINDOW_S}
    with local_service(args, HTTP_PORT) as base:
        wait_until(lambda: health_status(base) == 200, 60, f"{base}/health")
        yield base


@pytest.mark.timeout(420)
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")  # still Serve 2.60's knob
def test_a_load_step_adds_a_replica_after_the_delay_and_its_end_removes_it_losing_no_request(url: str) -> None:
    log = ReplicaLog()
    trickle, load = Traffic(url), Traffic(url)
    try:
        wait_until(lambda: bool(log.samples) and running(log.samples[-1][1]) == 1, 60, "one engine replica at rest")
        trickle.start(1, TRICKLE_TOKENS, "light")
        t_load = time.monotonic()
        load.start(LOAD_CLIENTS, LOAD_TOKENS, "load")
        t_two = wait_until(lambda: log.first(t_load, lambda s: running(s) == 2), UPSCALE_DELAY_S + UP_SLACK_S,
                           "a second engine replica under the load")
        # The load goes on over two replicas: a round of load requests sent once both ran.
        wait_until(lambda: sum(s.start >= t_two for s in load.sent) >= LOAD_CLIENTS, 120,
                   "a round of load requests on two replicas")
        t_stop = time.monotonic()
        t_calm = load.stop()
        t_one = wait_until(lambda: log.first(t_calm, lambda s: sum(s.values()) == 1 and running(s) == 1),
                           TTFT_WINDOW_S + DOWNSCALE_DELAY_S + DOWN_SLACK_S, "the deployment back to one replica")
        # ...and the light stream goes on, on the one replica left
        wait_until(lambda: any(s.start > t_one for s in trickle.sent), 60, "a light request answered after")
    finally:
        log.stop()
        load.stop()
        trickle.stop()

    t_starting = log.first(t_load, lambda s: sum(s.values()) == 2)  # Serve acts on the decision: a replica starts
    t_up = log.first(t_load, lambda s: running(s) == 2)
    t_leaving = log.first(t_stop, lambda s: running(s) == 1)  # ...a replica stops
    t_down = log.first(t_stop, lambda s: sum(s.values()) == 1)  # ...and is gone
    assert None not in (t_starting, t_up, t_leaving, t_down), log.samples[-20:]
    print(f"replica starting {t_starting - t_load:.1f}s after the load began, running at {t_up - t_load:.1f}s; "
          f"stopping {t_leaving - t_stop:.1f}s after the load was stopped, gone at {t_down - t_stop:.1f}s")
    # In order: a replica started under the load and ran before the load stopped; it stopped
    # only after, and was gone after that.
    assert t_load <= t_starting <= t_up < t_stop <= t_leaving <= t_down, (t_load, t_starting, t_up, t_stop,
                                                                         t_leaving, t_down)
    assert max(running(s) for _, s in log.samples) == 2  # never past max_replicas
    failed = [s for s in load.sent + trickle.sent if s.error is not None]
    assert not failed, failed[:5]
    # The light stream had requests in flight while the replica stopped, and after: none was lost.
    assert any(s.start <= t_down and s.end >= t_leaving for s in trickle.sent)
    assert any(s.start > t_down for s in trickle.sent)
    assert len(load.sent) >= LOAD_CLIENTS * 2
