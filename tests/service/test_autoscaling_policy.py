"""The TTFT autoscaling policy without Ray (service/autoscaling.py): its decision on the
replicas' reports (up only after the delay, down by one after its delay, within the bounds,
nothing without reports), the replica's TTFT window, what a replica reports from real streams, and
the app arguments that turn it on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from service.autoscaling import (DOWN_SINCE, TTFT_COUNT, TTFT_P90, UP_SINCE, WAITING, FleetLoad, Replicas,
                                 ScalingTargets, TTFTPolicy, TTFTWindow, decide, fleet_load, replica_stats,
                                 serve_autoscaling_config)

TARGETS = ScalingTargets(target_ttft_s=0.5, max_num_seqs=4, target_queue=2, upscale_delay_s=5.0,
                         downscale_delay_s=20.0, min_samples=5)
ONE_OF_THREE = Replicas(running=1, target=1, min=1, max=3)
SLOW = FleetLoad(replicas=1, waiting=0, running=4, ttft_p90_s=1.2, ttft_count=10)  # p90 above target
CALM = FleetLoad(replicas=2, waiting=0, running=3, ttft_p90_s=0.1, ttft_count=10)  # under half the target
STEADY = FleetLoad(replicas=1, waiting=0, running=4, ttft_p90_s=0.4, ttft_count=10)  # between the two


def run(loads: list[tuple[float, FleetLoad | None]], replicas: Replicas = ONE_OF_THREE,
        targets: ScalingTargets = TARGETS) -> list[int]:
    """The decision at each (time, load), the policy's state carried from one to the next."""
    state: dict[str, Any] = {}
    decisions = []
    for now, load in loads:
        n, state = decide(load, targets, replicas, state, now)
        decisions.append(n)
    return decisions


# ---- the decision ----------------------------------------------------------------------------

def test_a_replica_is_added_once_the_ttft_has_been_over_target_for_the_delay_not_before() -> None:
    assert run([(100.0, SLOW), (102.0, SLOW), (104.9, SLOW)]) == [1, 1, 1]
    # 1.2 s against 0.5 s: ceil(1 x 2.4) = 3 replicas, within max 3
    assert run([(100.0, SLOW), (102.0, SLOW), (105.0, SLOW)]) == [1, 1, 3]
    _, state = decide(SLOW, TARGETS, ONE_OF_THREE, {}, 100.0)
    assert state == {UP_SINCE: 100.0}


def test_a_break_in_the_pressure_restarts_the_upscale_delay() -> None:
    assert run([(100.0, SLOW), (103.0, STEADY), (104.0, SLOW), (108.0, SLOW), (109.0, SLOW)]) == [1, 1, 1, 1, 3]


def test_a_long_queue_adds_replicas_without_any_first_token() -> None:
    queued = FleetLoad(replicas=1, waiting=9, running=4, ttft_p90_s=0.0, ttft_count=0)
    # 13 requests, 4 running + 2 waiting per replica: ceil(13 / 6) = 3
    assert run([(0.0, queued), (5.0, queued)]) == [1, 3]
    # a queue at its target is no pressure
    at_target = FleetLoad(replicas=1, waiting=2, running=4, ttft_p90_s=0.0, ttft_count=0)
    assert run([(0.0, at_target), (50.0, at_target)]) == [1, 1]


def test_a_p90_over_too_few_first_tokens_adds_nothing() -> None:
    few = FleetLoad(replicas=1, waiting=0, running=1, ttft_p90_s=3.0, ttft_count=4)
    assert run([(0.0, few), (10.0, few)]) == [1, 1]


def test_a_replica_is_removed_one_at_a_time_after_the_downscale_delay() -> None:
    three = Replicas(running=3, target=3, min=1, max=3)
    assert run([(0.0, CALM), (19.9, CALM)], three) == [3, 3]
    assert run([(0.0, CALM), (10.0, CALM), (20.0, CALM)], three) == [3, 3, 2]
    _, state = decide(CALM, TARGETS, three, {}, 7.0)
    assert state == {DOWN_SINCE: 7.0}


@pytest.mark.parametrize("busy", [
    FleetLoad(replicas=2, waiting=1, running=8, ttft_p90_s=0.1, ttft_count=10),  # a request waits
    FleetLoad(replicas=2, waiting=0, running=5, ttft_p90_s=0.1, ttft_count=10),  # 5 running: more than one batch
    FleetLoad(replicas=2, waiting=0, running=3, ttft_p90_s=0.3, ttft_count=10),  # p90 over half the target
])
def test_no_replica_is_removed_while_the_others_could_not_take_the_load(busy: FleetLoad) -> None:
    two = Replicas(running=2, target=2, min=1, max=3)
    assert run([(0.0, busy), (100.0, busy)], two) == [2, 2]


def test_an_idle_fleet_goes_down_once_no_first_token_came_in_the_window() -> None:
    idle = FleetLoad(replicas=2, waiting=0, running=0, ttft_p90_s=0.0, ttft_count=0)
    assert run([(0.0, idle), (20.0, idle)], Replicas(2, 2, 1, 3)) == [2, 1]


def test_the_bounds_hold() -> None:
    at_max = Replicas(running=3, target=3, min=1, max=3)
    assert run([(0.0, SLOW), (100.0, SLOW)], at_max) == [3, 3]
    assert decide(SLOW, TARGETS, at_max, {}, 0.0)[1] == {}  # no timer for a scale-up that cannot happen
    at_min = Replicas(running=2, target=2, min=2, max=3)
    assert run([(0.0, CALM), (100.0, CALM)], at_min) == [2, 2]
    # far over target from one replica: the max, not ceil(1 x 40)
    assert run([(0.0, SLOW), (5.0, FleetLoad(1, 0, 4, 20.0, 10))], Replicas(1, 1, 1, 2)) == [1, 2]
    # bounds lowered under the target (Serve's capacity adjustment): within them at once
    assert decide(STEADY, TARGETS, Replicas(running=3, target=3, min=1, max=2), {}, 0.0)[0] == 2


def test_no_reports_change_nothing() -> None:
    two = Replicas(running=2, target=2, min=1, max=3)
    assert decide(None, TARGETS, two, {UP_SINCE: 0.0}, 100.0) == (2, {})
    assert fleet_load([]) is None
    assert fleet_load([{WAITING: 3.0}]) is None  # a report without every metric is no report


def test_it_holds_while_a_replica_is_still_starting() -> None:
    starting = Replicas(running=1, target=2, min=1, max=3)
    assert run([(0.0, SLOW), (100.0, SLOW)], starting) == [2, 2]


def test_the_fleet_p90_weighs_each_replica_by_its_first_tokens() -> None:
    reports = [replica_stats(window_of([1.0] * 9), num_waiting=2, num_running=4),
               {WAITING: 0.0, "qkv_running_requests": 1.0, TTFT_P90: 0.1, TTFT_COUNT: 1.0}]
    load = fleet_load(reports)
    assert load is not None
    assert (load.replicas, load.waiting, load.running, load.ttft_count) == (2, 2.0, 5.0, 10.0)
    assert load.ttft_p90_s == pytest.approx((9 * 1.0 + 0.1) / 10)


def test_targets_are_checked() -> None:
    with pytest.raises(ValueError, match="target_ttft_s must be > 0, got 0"):
        ScalingTargets(target_ttft_s=0, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"low_water must be in \(0, 1\], got 2"):
        ScalingTargets(target_ttft_s=1, max_num_seqs=4, low_water=2)


# ---- Serve's side: the context and the config --------------------------------------------------

def test_the_policy_reads_each_replicas_latest_report_from_serves_context() -> None:
    def series(*values: float) -> list[Any]:
        return [SimpleNamespace(timestamp=float(i), value=v) for i, v in enumerate(values)]

    policy = TTFTPolicy(target_ttft_s=0.5, max_num_seqs=4, target_queue=2, upscale_delay_s=5.0, downscale_delay_s=20.0)
    raw = {WAITING: {"r1": series(5, 0)}, "qkv_running_requests": {"r1": series(4, 4)},
           TTFT_P90: {"r1": series(0.1, 2.0)}, TTFT_COUNT: {"r1": series(1, 20)}}

    def ctx(now: float, state: dict[str, Any]) -> Any:
        return SimpleNamespace(current_num_replicas=1, target_num_replicas=1, capacity_adjusted_min_replicas=1,
                               capacity_adjusted_max_replicas=2, raw_metrics=raw, policy_state=state,
                               current_time=now)

    n, state = policy(ctx(50.0, {"serve_internal": 1}))
    assert (n, state) == (1, {UP_SINCE: 50.0})  # the latest p90 (2.0 s) is over target: the delay starts
    assert policy(ctx(55.0, state)) == (2, {})
    assert policy(SimpleNamespace(**{**vars(ctx(60.0, {})), "raw_metrics": None})) == (1, {})


def test_the_serve_config_carries_the_policy_and_turns_serves_own_delays_off() -> None:
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(**serve_autoscaling_config({"min_replicas": 1, "max_replicas": 2}, TARGETS))
    assert (config.min_replicas, config.max_replicas, config.upscale_delay_s, config.downscale_delay_s) == (1, 2, 0, 0)
    policy_class = config.policy.get_policy()
    policy = policy_class(**config.policy.policy_kwargs)
    assert policy.targets == TARGETS


# ---- the replica's window and report ----------------------------------------------------------

def window_of(values: list[float], window_s: float = 10.0) -> TTFTWindow:
    window = TTFTWindow(window_s, clock=lambda: 0.0)
    for v in values:
        window.add(v)
    return window


def test_the_window_gives_the_p90_of_what_it_holds() -> None:
    assert window_of([i / 10 for i in range(10, 0, -1)]).quantile(0.9) == (0.9, 10)
    assert window_of([0.3]).quantile(0.9) == (0.3, 1)
    assert window_of([]).quantile(0.9) == (0.0, 0)


def test_the_window_drops_old_samples_by_time_and_by_count() -> None:
    now = [0.0]
    window = TTFTWindow(window_s=5.0, max_samples=100, clock=lambda: now[0])
    for t, ttft in ((0.0, 9.0), (0.4, 8.0), (4.0, 0.2), (5.5, 0.1)):
        now[0] = t
        window.add(ttft)
    assert window.quantile(0.9) == (0.2, 2)  # the two before 0.5 s are out
    now[0] = 9.2
    assert window.quantile(0.9) == (0.1, 1)
    now[0] = 11.0
    assert window.quantile(0.9) == (0.0, 0)
    bounded = TTFTWindow(window_s=60.0, max_samples=4, clock=lambda: 0.0)
    for ttft in (5.0, 5.0, 1.0, 1.0, 1.0, 1.0):
        bounded.add(ttft)
    assert bounded.quantile(0.9) == (1.0, 4)  # the newest four


def test_a_replica_reports_the_first_token_latency_of_each_request(tmp_path: Any) -> None:
    """EngineHost over a real engine: each request's first token lands in the window once."""
    from model.config import EngineConfig
    from model.engine.builder import build_engine
    from model.sampling.params import SamplingParams
    from service.engine.engine_loop import SubRequest
    from service.host.engine_host import EngineHost
    from tests.support.in_process import NullMetrics
    from tests.support.local_serve import write_tiny_checkpoint

    engine = build_engine(str(write_tiny_checkpoint(tmp_path / "tiny")), EngineConfig(max_num_seqs=1, num_kv_blocks=64))

    async def serve_three() -> tuple[dict[str, float], list[Any]]:
        host = EngineHost(engine, "tiny", metrics=NullMetrics())
        try:
            assert host.autoscaling_stats() == {WAITING: 0.0, "qkv_running_requests": 0.0, TTFT_P90: 0.0,
                                                TTFT_COUNT: 0.0}
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            streams = [host.generate([SubRequest(f"r{i}", [1 + i, 2, 3], params)]) for i in range(3)]

            async def times_of(stream: Any) -> Any:
                times = None
                async for batch in stream:
                    times = batch[-1].times
                assert times is not None and times.first_token is not None and times.last_token is not None
                return times
            times = await asyncio.wait_for(asyncio.gather(*(times_of(s) for s in streams)), 60)
            return host.autoscaling_stats(), times
        finally:
            host.stop()

    stats, times = asyncio.run(serve_three())
    assert stats[TTFT_COUNT] == 3.0
    # One sequence at a time: each request was first scheduled only after the one before it had
    # produced its last token (the engine's own timestamps, in order, not a measured duration)...
    runs = sorted(times, key=lambda t: t.first_token)
    assert all(later.first_scheduled >= earlier.last_token for earlier, later in zip(runs, runs[1:]))
    # ...and p90 of three (nearest rank) is the slowest first token of the three.
    assert stats[TTFT_P90] == pytest.approx(max(t.first_token - t.arrival for t in times))
    assert (stats[WAITING], stats["qkv_running_requests"]) == (0.0, 0.0)


# ---- the app arguments ------------------------------------------------------------------------

def test_the_target_turns_the_policy_on_and_without_it_serves_config_is_untouched() -> None:
    from service.app import AppArgs, engine_options

    bounds = {"min_replicas": 1, "max_replicas": 3, "look_back_period_s": 2.0}
    args = AppArgs(accelerator="cpu", max_num_seqs=8, autoscaling_config=bounds, autoscaling_target_ttft_s=0.8,
                   autoscaling_upscale_delay_s=3, autoscaling_downscale_delay_s=9, autoscaling_target_queue=1)
    config = engine_options(args)["autoscaling_config"]
    assert config["policy"]["policy_function"] == "service.autoscaling:TTFTPolicy"
    assert config["policy"]["policy_kwargs"] == {"target_ttft_s": 0.8, "max_num_seqs": 8, "target_queue": 1,
                                                      "upscale_delay_s": 3.0, "downscale_delay_s": 9.0,
                                                      "low_water": 0.5, "min_samples": 5}
    assert (config["look_back_period_s"], config["upscale_delay_s"], config["downscale_delay_s"]) == (2.0, 0.0, 0.0)
    assert engine_options(AppArgs(accelerator="cpu", autoscaling_config=bounds))["autoscaling_config"] == bounds


@pytest.mark.parametrize("bad, message", [
    ({"autoscaling_target_ttft_s": 0.5}, "needs autoscaling_config with the bounds"),
    ({"autoscaling_target_ttft_s": 0.5, "autoscaling_config": {"min_replicas": 1}}, "needs autoscaling_config"),
    ({"autoscaling_target_ttft_s": 0.5, "autoscaling_config": {"min_replicas": 0, "max_replicas": 2}},
     "min_replicas must be >= 1 with autoscaling_target_ttft_s"),
    ({"autoscaling_target_ttft_s": 0.5, "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}},
     r"max_replicas must be >= min_replicas \(3\), got 2"),
    ({"autoscaling_target_ttft_s": 0.5, "autoscaling_config": {"max_replicas": 2, "upscale_delay_s": 1}},
     "upscale_delay_s do not apply with autoscaling_target_ttft_s"),
    ({"autoscaling_target_ttft_s": 0, "autoscaling_config": {"max_replicas": 2}}, "greater than 0"),
    ({"autoscaling_target_ttft_s": 0.5, "autoscaling_config": {"max_replicas": 2}, "autoscaling_target_queue": -1},
     "greater than or equal to 0"),
])
def test_bad_autoscaling_arguments_say_what_is_wrong(bad: dict[str, Any], message: str) -> None:
    from service.app import AppArgs

    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(bad)
