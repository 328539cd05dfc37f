"""Prefill/decode disaggregation on real Ray Serve: a `Prefill` deployment and the engine
deployment that decodes, the prompt's KV blocks moved through Ray's object store. Greedy text
equals colocated serving (the offline engine on the same checkpoint); the decode replica reports
the transferred prompt as cached tokens; a prefill replica killed mid-transfer costs the request
nothing (the decode replica prefills it itself, same text) and leaves no block held; Serve's
replacement prefill replica serves the next request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import requests
import yaml
from ray import serve

from tests.support.local_serve import SharedServe, write_tiny_checkpoint
from tests.support.serve_fixtures import wait_until
from tests.support.paths import REPO

pytestmark = pytest.mark.slow

SLOW = "SLOW-EXPORT"  # a prompt with it: the prefill replica sleeps before handing its blocks over
# ...this long: the test's kill lands inside it however loaded the machine (a hang bound), and a
# kill that missed would show (under prefill_timeout_s, the transfer would then succeed).
SLOW_EXPORT_S = 25.0
PROMPT = "Disaggregated serving: the prefill deployment computes this prompt once. " * 2


@pytest.fixture(scope="module")
def export_started(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Created by the prefill replica as it begins its slow export (`fault_injection.SlowExport`)."""
    return tmp_path_factory.mktemp("pd-export") / "started"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe,
            export_started: Path) -> Iterator[tuple[str, str]]:
    ckpt = str(write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny"))
    (app,) = yaml.safe_load((REPO / "deploy" / "serve-pd.yaml").read_text())["applications"]
    args = app["args"] | {"model": ckpt, "prefill_min_tokens": 32, "max_num_seqs": 4, "num_kv_blocks": 64,
                          "engine_num_cpus": 0.5, "prefill_num_cpus": 0.5, "torch_threads": 1, "prefill_timeout_s": 30}
    assert args["prefill_replicas"] == 1 and args["num_replicas"] == 1
    with shared_serve(args, slow_export_marker=SLOW, slow_export_s=SLOW_EXPORT_S,
                      slow_export_started=str(export_started)) as url:
        yield url, ckpt


def colocated(ckpt: str, prompt: str) -> str:
    from model import LLM, SamplingParams

    return LLM(ckpt).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text


def complete(url: str, prompt: str) -> dict[str, Any]:
    r = requests.post(f"{url}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text[:300]
    return r.json()


def cached(answer: dict[str, Any]) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def decode_stats() -> dict[str, Any]:
    return serve.get_deployment_handle("EngineDeployment", app_name="qkv").engine_stats.remote().result(timeout_s=30)


def test_the_rayservice_example_runs_prefill_and_decode_replicas() -> None:
    from tests.support.serve_fixtures import read_rayservice

    _, args, cluster, container = read_rayservice("rayservice-pd.yaml")
    assert args.prefill_replicas >= 1 and args.num_replicas >= 1 and args.accelerator == "auto"
    (workers,) = cluster["workerGroupSpecs"]
    # one GPU per pod and per replica: the pods hold every prefill and decode replica
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert workers["replicas"] >= args.prefill_replicas + args.num_replicas


def test_a_prompt_prefilled_elsewhere_decodes_to_the_colocated_text(service: tuple[str, str]) -> None:
    url, ckpt = service
    answer = complete(url, PROMPT)
    assert answer["choices"][0]["text"] == colocated(ckpt, PROMPT)
    # The decode replica never computed this prompt: its cached tokens came from the transfer.
    assert cached(answer) >= answer["usage"]["prompt_tokens"] // 2
    # A short prompt is prefilled by the decode replica itself.
    assert cached(complete(url, "short")) == 0


def test_a_prefill_replica_killed_mid_transfer_costs_the_request_nothing(service: tuple[str, str],
                                                                        export_started: Path) -> None:
    url, ckpt = service
    prompt = f"{SLOW} " + PROMPT
    got: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: got.update(complete(url, prompt)))
    worker.start()
    wait_until(export_started.exists, 60, "the prefill replica to be asleep in its export")  # kill it there
    victims = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::qkv#Prefill#")]
    assert len(victims) == 1
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
    worker.join(120)
    assert got["choices"][0]["text"] == colocated(ckpt, prompt)
    assert cached(got) == 0  # prefilled by the decode replica itself
    stats = decode_stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    # Serve replaces the prefill replica; a new prompt is prefilled there again.
    fresh = "After the replacement: " + PROMPT
    wait_until(lambda: cached(complete(url, fresh + str(time.monotonic_ns()))) > 0, 90,
               "a replacement prefill replica to serve a transfer")
