"""Tensor parallelism behind Ray Serve (issue 29): the app's arguments and deployment options
(no Ray), and a real Serve app with `tensor_parallel_size=2` on a local Ray (gloo on the CPU):
completions and chat over HTTP equal to a TP=1 `LLM` in this process, the replica's placement
group and its two workers in Ray's state API, and a killed worker leading to 503s (never a
hang), a failed check_health, and a replaced replica with a new group and new workers.

Bounds the tests state (hang bounds, far above the normal times): a request in flight when a
worker dies ends with a 503 or an error event, never with a client read that gave up after
CLIENT_TIMEOUT_S (half the workers' 60 s step deadline: the error is the death's, not the
deadline's); a dead idle worker fails /health within DETECT_S (Serve's health check period is
5 s); the service answers again within RECOVERY_S.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from tests.support.serve_fixtures import health_status, read_rayservice, sse_payloads
from service.app import AppArgs, compose_app
from service.replica.placement import engine_device, replica_resources, warn_if_unplaceable
from tests.support.tiny_models import torch_threads

HTTP_PORT, DASHBOARD_PORT, METRICS_PORT = 18370, 18371, 18372
MODEL = "tp"
CLIENT_TIMEOUT_S = 30.0
DETECT_S = 60.0
RECOVERY_S = 60.0
REPLICA_CLASS = "ServeReplica:qkv:EngineDeployment"


# ---- the app's arguments and deployment options (no Ray) ---------------------------------------


def _options(app: Any) -> tuple[dict[str, Any], list[dict[str, float]] | None, str | None]:
    deployment = app._bound_deployment  # what Serve will deploy: its actor options and group
    replica = deployment._replica_config
    return deployment.ray_actor_options, replica.placement_group_bundles, replica.placement_group_strategy


def test_tensor_parallel_arguments_validate_and_reach_the_engine_config() -> None:
    args = AppArgs.model_validate({"tensor_parallel_size": "2", "tp_worker_num_cpus": "0.5"})
    assert (args.tensor_parallel_size, args.tp_worker_num_cpus, args.pipeline_parallel_size) == (2, 0.5, 1)
    config = args.engine_config()
    assert (config["tensor_parallel_size"], config["tp_worker_num_cpus"], config["pipeline_parallel_size"]) == (2, 0.5, 1)
    for bad in ({"tensor_parallel_size": 0}, {"tp_worker_num_cpus": 0}, {"placement_group_strategy": "NODE"}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)
    with pytest.raises(ValidationError, match="pipeline_parallel_size must be 1, got 2: pipeline parallelism"):
        AppArgs.model_validate({"pipeline_parallel_size": 2})


def test_one_rank_keeps_the_single_actor_replica() -> None:
    actor, bundles, _ = _options(compose_app(AppArgs(accelerator="cpu", engine_num_cpus=2)))
    assert actor == {"num_cpus": 2, "num_gpus": 0} and bundles is None
    assert replica_resources(1.0, gpu=True) == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1}}


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"])
def test_tensor_parallel_replica_reserves_a_group_per_replica(strategy: str) -> None:
    args = AppArgs(accelerator="cpu", tensor_parallel_size=2, engine_num_cpus=0.5, tp_worker_num_cpus=0.25,
                   placement_group_strategy=strategy, autoscaling_config={"min_replicas": 1, "max_replicas": 3})
    actor, bundles, got = _options(compose_app(args))
    # bundle 0 is the replica (Serve schedules it there), bundles 1.. its workers
    assert actor == {"num_cpus": 0.5, "num_gpus": 0}
    assert bundles == [{"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.25}] and got == strategy
    # on GPU each worker holds one GPU and the replica's driver none
    gpu = replica_resources(2.0, gpu=True, tensor_parallel_size=4, tp_worker_num_cpus=1.0)
    assert gpu["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0}
    assert gpu["placement_group_bundles"] == [{"CPU": 2.0}] + [{"CPU": 1.0, "GPU": 1}] * 4
    assert gpu["placement_group_strategy"] == "PACK"


def test_the_replica_builds_its_engine_for_its_workers_devices() -> None:
    assert engine_device(gpu=False, tensor_parallel_size=2) == "cpu"
    assert engine_device(gpu=True) == "cuda"
    # a tensor-parallel replica holds no GPU: its driver stays on the CPU, the engine puts the workers on GPUs
    assert engine_device(gpu=True, tensor_parallel_size=2) == "auto"
    init = compose_app(AppArgs(accelerator="cpu", tensor_parallel_size=2))._bound_deployment.init_kwargs
    assert init["device"] == "cpu" and init["engine_config"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize("bad", [{"quantization": "int8"}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}])
def test_what_tensor_parallelism_cannot_combine_with_fails_at_build_time(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size"):
        compose_app(AppArgs(accelerator="cpu", tensor_parallel_size=2, **bad))
    compose_app(AppArgs(accelerator="cpu", **bad))  # fine on one rank


def test_a_group_larger_than_the_cluster_is_named_at_build_time() -> None:
    options = replica_resources(1.0, gpu=True, tensor_parallel_size=4, tp_worker_num_cpus=1.0)
    message = warn_if_unplaceable(options, {"CPU": 16.0, "GPU": 2.0})
    assert message is not None and "4 GPU (the cluster has 2)" in message and "CPU" not in message
    assert warn_if_unplaceable(options, {"CPU": 5.0, "GPU": 4.0}) is None
    assert warn_if_unplaceable(replica_resources(1.0, gpu=False), {"CPU": 0.5}) is None  # no group


def test_rayservice_tp_example_validates_and_fits_its_worker_pods() -> None:
    from service.launch import SERVING_ENV

    _, args, _, container = read_rayservice("rayservice-tp.yaml")
    assert args.tensor_parallel_size >= 2 and args.accelerator == "auto"
    assert {e["name"]: e["value"] for e in container["env"]} == SERVING_ENV
    limits = container["resources"]["limits"]
    # PACK puts one replica's whole group on one pod when it fits: the pod holds every bundle
    bundles = replica_resources(args.engine_num_cpus, True, args.tensor_parallel_size, args.tp_worker_num_cpus,
                                args.placement_group_strategy)["placement_group_bundles"]
    assert int(limits["nvidia.com/gpu"]) >= sum(b.get("GPU", 0) for b in bundles)
    assert float(limits["cpu"]) >= sum(b["CPU"] for b in bundles)


# ---- a tensor-parallel Serve app on a local Ray -----------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.local_serve import write_tiny_checkpoint

    # long enough for a request that is still running when a worker is killed
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tp", max_position=4096)


@pytest.fixture(scope="module")
def base_url(checkpoint: Path) -> Iterator[str]:
    from tests.support.serve_fixtures import serve_on_local_ray

    args = {"model": str(checkpoint), "served_model_name": MODEL, "accelerator": "cpu", "tensor_parallel_size": 2,
            "engine_num_cpus": 0.5, "tp_worker_num_cpus": 0.5, "max_num_seqs": 8, "num_kv_blocks": 600,
            "graceful_shutdown_timeout_s": 1}
    # 3 CPUs: one group (1.5) serving and the replacement's group starting beside it; the
    # dashboard serves Ray's state API
    with serve_on_local_ray(args, HTTP_PORT, DASHBOARD_PORT, METRICS_PORT, num_cpus=3) as (url, _):
        yield url


def _group() -> tuple[str, list[dict[str, Any]], list[str]] | None:
    """The one CREATED placement group: (id, its bundles' resources, the ids of its live worker
    actors); None until it and both workers are up."""
    from ray.util.state import list_actors, list_placement_groups

    groups = list_placement_groups(filters=[("state", "=", "CREATED")], detail=True, timeout=10)
    if len(groups) != 1:
        return None
    group = groups[0]
    actors = list_actors(filters=[("placement_group_id", "=", group.placement_group_id), ("state", "=", "ALIVE")],
                         timeout=10)
    workers = sorted(a.actor_id for a in actors if a.class_name != REPLICA_CLASS)
    if len(workers) != 2 or len(actors) != 3:
        return None
    return group.placement_group_id, [b["unit_resources"] for b in group.bundles], workers


def _completion(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)


def _reference(checkpoint: Path) -> Any:
    from model import LLM

    return LLM(str(checkpoint))


def _greedy(llm: Any, prompt: str | list[int], max_tokens: int = 12) -> str:
    from model import SamplingParams

    # One thread, as the workers run (tp_worker_num_cpus 0.5): restored after, so the modules
    # that follow in the same pytest process keep their threads.
    with torch_threads(1):
        return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True))[0].text


def _assert_503(r: httpx.Response, started: bool = False) -> None:
    """A 503 in the OpenAI shape; `started`: a non-streamed answer whose response may have started
    (service/server/api.py HeldResponse), which carries the error as the body of its 200 instead."""
    assert r.status_code == 503 or (started and r.status_code == 200), r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error", error
    assert "retry" in error["message"] and "Traceback" not in r.text


def _long_stream(url: str) -> tuple[int, list[Any]]:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as r:
        return r.status_code, sse_payloads(r.iter_lines())


def _replaced(before: str) -> tuple[str, list[dict[str, Any]], list[str]] | None:
    group = _group()
    return group if group is not None and group[0] != before else None


def _running(n: int) -> bool:
    from ray import serve

    handle = serve.get_deployment_handle("EngineDeployment", app_name="qkv")
    return handle.engine_stats.remote().result(timeout_s=10)["num_running"] == n


def _dead(actor_ids: list[str]) -> bool:
    from ray.util.state import get_actor

    return all((a := get_actor(actor_id, timeout=10)) is not None and a.state == "DEAD" for actor_id in actor_ids)


@pytest.mark.slow
def test_tensor_parallel_app_serves_completions_and_chat_equal_to_one_rank(base_url: str, checkpoint: Path) -> None:
    from tests.support.serve_fixtures import wait_until

    group_id, bundles, workers = wait_until(_group, 60, "the placement group and its two workers")
    assert bundles == [{"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 0.5}]
    llm = _reference(checkpoint)
    for prompt in ("The cat", "Attention is all"):
        r = _completion(base_url, prompt)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["text"] == _greedy(llm, prompt)
    messages = [{"role": "user", "content": "Hello there"}]
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": messages},
                        timeout=CLIENT_TIMEOUT_S).json()["tokens"]
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["message"]["content"] == _greedy(llm, tokens)
    assert _group() == (group_id, bundles, workers)  # nothing was restarted


@pytest.mark.slow
def test_a_worker_killed_mid_request_gives_503s_and_a_new_group(base_url: str, checkpoint: Path) -> None:
    from tests.support.serve_fixtures import wait_until

    group_id, _, workers = wait_until(_group, 60, "the placement group and its two workers")
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_long_stream, base_url)
        plain = pool.submit(_completion, base_url, "abc", 4000)
        wait_until(lambda: _running(2), 60, "two long requests in the batch")
        _kill(workers[0])
        # An httpx.ReadTimeout here (the stream's reads give up after CLIENT_TIMEOUT_S) would be a hang.
        r, (status, events) = plain.result(), streamed.result()
    _assert_503(r, started=True)  # it ran past its first token before the kill
    assert status == 200 and events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    _assert_503(_completion(base_url, "after the kill"))  # the next request too, not a hang
    new_id, _, new_workers = wait_until(lambda: _replaced(group_id), RECOVERY_S, "a new replica with a new group")
    assert set(new_workers).isdisjoint(workers)
    wait_until(lambda: _dead(workers), 60, "the old group's workers to be gone (no leaked actors)")
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "the service to answer again")
    r = _completion(base_url, "The cat")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _greedy(_reference(checkpoint), "The cat")


@pytest.mark.slow
def test_a_worker_dead_while_idle_fails_check_health_and_the_replica_is_replaced(base_url: str) -> None:
    from tests.support.serve_fixtures import wait_until

    group_id, _, workers = wait_until(_group, RECOVERY_S, "the placement group and its two workers")
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "the service to be healthy")
    _kill(workers[1])
    # no request runs a step: only the replica's check of its workers can notice
    wait_until(lambda: health_status(base_url) == 503, DETECT_S, "/health to report the dead worker")
    new_id, _, new_workers = wait_until(lambda: _replaced(group_id), RECOVERY_S, "a new replica with a new group")
    assert set(new_workers).isdisjoint(workers)
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "the service to answer again")
    assert _completion(base_url, "The cat").status_code == 200
    wait_until(lambda: _dead(workers), 60, "the old group's workers to be gone")


def _kill(actor_id: str) -> None:
    """Kill a live worker actor: `ray.kill` when it has a name to get a handle by, else its
    process with SIGKILL (a crash; Ray has no public handle-by-id)."""
    import os
    import signal

    import ray
    from ray.util.state import get_actor

    actor = get_actor(actor_id, timeout=10)
    assert actor is not None and actor.state == "ALIVE", actor
    if actor.name:
        ray.kill(ray.get_actor(actor.name, namespace=actor.ray_namespace), no_restart=True)
    else:
        os.kill(actor.pid, signal.SIGKILL)
