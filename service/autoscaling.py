"""Autoscaling the engine deployment on what its users wait for: time to first token and queue.

Each engine replica keeps the first-token latencies of its last few seconds (`TTFTWindow`) and
hands Serve, from `record_autoscaling_stats`, its waiting and running requests and that window's
p90 with the number of first tokens it holds (`replica_stats`). Serve's controller calls
`TTFTPolicy` on each tick of its control loop; the policy reads the latest report of every running
replica (`fleet_load`) and `decide`s:

- **up** when the p90 is above `target_ttft_s` (over at least `min_samples` first tokens) or the
  waiting requests per replica are above `target_queue`, held for `upscale_delay_s`: to as many
  replicas as bring both under target, assuming TTFT falls in proportion to the replicas and a
  replica takes `max_num_seqs` running plus `target_queue` waiting (at least one more);
- **down by one** when the p90 is below `low_water` x `target_ttft_s` (or no first token came), no
  request waits and the running ones fit in one replica fewer, held for `downscale_delay_s`;
- otherwise, or while Serve is still adding or removing a replica, it holds; always within the
  context's capacity-adjusted min and max. Its timers live in the context's `policy_state`.

Serve 2.60 wraps every custom policy in its own delays (the config's `upscale_delay_s` and
`downscale_delay_s`) and bounds: `serve_autoscaling_config` sets Serve's delays to 0, so the one
delay is the policy's, held on these signals and tested with them (tests/service/test_autoscaling_policy.py).

The module imports nothing of the project: Serve pickles it by value into its controller.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# What a replica reports (Serve's custom metrics: names to numbers).
WAITING = "qkv_waiting_requests"
RUNNING = "qkv_running_requests"
TTFT_P90 = "qkv_ttft_p90_s"
TTFT_COUNT = "qkv_ttft_count"
REPLICA_METRICS = (WAITING, RUNNING, TTFT_P90, TTFT_COUNT)

TTFT_WINDOW_S = 10.0  # a replica's window of first-token latencies, by default
TTFT_WINDOW_SAMPLES = 1024  # ...and at most this many of them (the newest)
POLICY_PATH = "service.autoscaling:TTFTPolicy"
# Keys of Serve's autoscaling_config that this policy replaces.
REPLACED_SERVE_KEYS = frozenset({"policy", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"})
# The policy's timers in Serve's policy_state: since when a scale-up (-down) has been wanted.
UP_SINCE, DOWN_SINCE = "qkv_up_since", "qkv_down_since"


class TTFTWindow:
    """The first-token latencies of the last `window_s` seconds, at most `max_samples` (the newest).
    `add` is O(1) amortized; `quantile` sorts what the window holds. Use from one thread."""

    def __init__(self, window_s: float = TTFT_WINDOW_S, max_samples: int = TTFT_WINDOW_SAMPLES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0 or max_samples < 1:
            raise ValueError(f"window_s must be > 0 and max_samples >= 1, got {window_s} and {max_samples}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (when added, TTFT)
        self._clock = clock

    def add(self, ttft_s: float) -> None:
        now = self._clock()
        self._drop_older_than(now - self.window_s)
        self._samples.append((now, max(ttft_s, 0.0)))

    def quantile(self, q: float) -> tuple[float, int]:
        """The `q` quantile (nearest rank) of the window and how many latencies it holds; (0.0, 0)
        when it holds none."""
        self._drop_older_than(self._clock() - self.window_s)
        if not self._samples:
            return 0.0, 0
        values = sorted(ttft for _, ttft in self._samples)
        return values[max(math.ceil(q * len(values)) - 1, 0)], len(values)

    def _drop_older_than(self, t: float) -> None:
        while self._samples and self._samples[0][0] < t:
            self._samples.popleft()


def replica_stats(window: TTFTWindow, num_waiting: int, num_running: int) -> dict[str, float]:
    """One replica's report to Serve (`REPLICA_METRICS`)."""
    p90, count = window.quantile(0.9)
    return {WAITING: float(num_waiting), RUNNING: float(num_running), TTFT_P90: p90, TTFT_COUNT: float(count)}


@dataclass(frozen=True)
class FleetLoad:
    """The replicas' latest reports taken together."""

    replicas: int  # that reported
    waiting: float
    running: float
    ttft_p90_s: float  # the replicas' p90s weighted by their first tokens (0 without any)
    ttft_count: float


def fleet_load(reports: Iterable[Mapping[str, float]]) -> FleetLoad | None:
    """`reports` (one per replica) together; None when no replica has reported every metric."""
    complete = [r for r in reports if all(name in r for name in REPLICA_METRICS)]
    if not complete:
        return None
    count = sum(r[TTFT_COUNT] for r in complete)
    p90 = sum(r[TTFT_P90] * r[TTFT_COUNT] for r in complete) / count if count else 0.0
    return FleetLoad(len(complete), sum(r[WAITING] for r in complete), sum(r[RUNNING] for r in complete), p90, count)


@dataclass(frozen=True)
class ScalingTargets:
    """What the policy aims for (`TTFTPolicy`'s keyword arguments)."""

    target_ttft_s: float
    max_num_seqs: int  # a replica's running batch
    target_queue: int = 4  # waiting requests per replica
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    low_water: float = 0.5  # scale down only under this fraction of target_ttft_s
    min_samples: int = 5  # first tokens (all replicas) a p90 needs to add a replica

    def __post_init__(self) -> None:
        checks = (("target_ttft_s", self.target_ttft_s > 0, "> 0"), ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
                  ("target_queue", self.target_queue >= 0, ">= 0"),
                  ("upscale_delay_s", self.upscale_delay_s >= 0, ">= 0"),
                  ("downscale_delay_s", self.downscale_delay_s >= 0, ">= 0"),
                  ("low_water", 0 < self.low_water <= 1, "in (0, 1]"), ("min_samples", self.min_samples >= 1, ">= 1"))
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)}")

    def ttft_high(self, load: FleetLoad) -> bool:
        return load.ttft_count >= self.min_samples and load.ttft_p90_s > self.target_ttft_s

    def under_pressure(self, load: FleetLoad) -> bool:
        return self.ttft_high(load) or load.waiting / load.replicas > self.target_queue

    def idle_enough(self, load: FleetLoad, replicas: int) -> bool:
        """Whether one replica fewer would do: TTFT well under target, nothing waiting, and the
        running requests fit in the batches of the others."""
        calm = load.ttft_count == 0 or load.ttft_p90_s < self.low_water * self.target_ttft_s
        return calm and load.waiting == 0 and load.running <= (replicas - 1) * self.max_num_seqs

    def wanted(self, load: FleetLoad, replicas: int) -> int:
        """Replicas for a fleet under pressure: enough for both targets, at least one more."""
        by_ttft = math.ceil(replicas * load.ttft_p90_s / self.target_ttft_s) if self.ttft_high(load) else replicas
        by_queue = math.ceil((load.waiting + load.running) / (self.max_num_seqs + self.target_queue))
        return max(replicas + 1, by_ttft, by_queue)


@dataclass(frozen=True)
class Replicas:
    """Where the deployment stands (from Serve's AutoscalingContext)."""

    running: int
    target: int  # what Serve is heading for: above `running` while a replica starts
    min: int  # capacity-adjusted bounds
    max: int

    def clamp(self, n: int) -> int:
        return max(self.min, min(self.max, n))


def decide(load: FleetLoad | None, targets: ScalingTargets, replicas: Replicas, state: Mapping[str, Any],
           now: float) -> tuple[int, dict[str, Any]]:
    """The replicas to run and the policy's new state (its timers: `UP_SINCE`, `DOWN_SINCE`, seconds
    on the clock of `now`). Holds, and restarts its timers, without reports or while a change is
    under way (its effect cannot be seen yet)."""
    hold = replicas.clamp(replicas.target)
    if load is None or replicas.running != replicas.target:
        return hold, {}
    n = replicas.running
    if targets.under_pressure(load) and n < replicas.max:
        since = state.get(UP_SINCE, now)
        if now - since >= targets.upscale_delay_s:
            return replicas.clamp(targets.wanted(load, n)), {}
        return hold, {UP_SINCE: since}
    if targets.idle_enough(load, n) and n > replicas.min:
        since = state.get(DOWN_SINCE, now)
        if now - since >= targets.downscale_delay_s:
            return replicas.clamp(n - 1), {}
        return hold, {DOWN_SINCE: since}
    return hold, {}


def latest_reports(raw_metrics: Mapping[str, Mapping[Any, list[Any]]]) -> list[dict[str, float]]:
    """Each replica's latest value of each metric, from Serve's raw metrics (metric -> replica ->
    time series of points with `.value`)."""
    by_replica: dict[Any, dict[str, float]] = {}
    for name, series_of in raw_metrics.items():
        for replica, series in series_of.items():
            if series:
                by_replica.setdefault(replica, {})[name] = float(series[-1].value)
    return list(by_replica.values())


class TTFTPolicy:
    """Serve's custom autoscaling policy for the engine deployment. Serve makes one with the
    config's `policy_kwargs` (`ScalingTargets`' fields) and calls it on every tick of its control
    loop with an `AutoscalingContext`."""

    def __init__(self, **targets: Any) -> None:
        self.targets = ScalingTargets(**targets)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        replicas = Replicas(ctx.current_num_replicas, ctx.target_num_replicas, ctx.capacity_adjusted_min_replicas,
                            ctx.capacity_adjusted_max_replicas)
        load = fleet_load(latest_reports(ctx.raw_metrics or {}))
        now = ctx.current_time if ctx.current_time is not None else time.time()
        return decide(load, self.targets, replicas, ctx.policy_state, now)


def serve_autoscaling_config(serve_config: Mapping[str, Any], targets: ScalingTargets) -> dict[str, Any]:
    """The deployment's `autoscaling_config`: `serve_config` (min_replicas, max_replicas, Serve's
    metrics intervals) with `TTFTPolicy` as its policy, and Serve's own delays off (the policy's apply)."""
    return {**serve_config, "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": asdict(targets)}}
