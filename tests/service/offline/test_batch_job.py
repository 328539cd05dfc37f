"""Large batches as Ray Data jobs (service/offline/batch_job.py): a batch handed to the job on a
local Ray gets, line by line, the answer the replica's interactive endpoint gives the same request
(greedy), errors included, and the replica's own engine is never asked; which batches are handed
off (tenants with quotas and a cluster too small for one actor are not)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import ray

from model.config import EngineConfig
from model.engine.builder import build_engine
from service.batch.api import in_process_send
from service.batch.files import FileStore
from service.batch.runner import BatchRunner
from service.engine.engine_loop import TorchThread
from service.host.engine_host import EngineHost
from service.offline.batch_job import EdgeSpec, NullMetrics, OfflineBatches
from service.server.api import IngressSettings, build_api, edge_serving
from service.tenancy.keys import Limits, Tenant

NAME = "tiny-chat"
ENGINE = {"max_num_seqs": 4}
ACTOR_CPUS = 0.5  # Ray gives the actor one torch thread: the reference runs on one too (same float sums)
MAX_MODEL_LEN = 1024  # the tiny Qwen3's max_position_embeddings (tests/support/chat_tokenizers.py)


def spec(model_dir: str) -> EdgeSpec:
    return EdgeSpec(model_dir, NAME, ENGINE, dataclasses.asdict(IngressSettings()))


def lines() -> list[dict[str, Any]]:
    completions = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": NAME, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}}
                   for i, p in enumerate(["The cat sat", "Attention is all", "Le chat", "In the beginning",
                                          "Once upon a time", "A token"])]
    refused = [{"custom_id": "long", "method": "POST", "url": "/v1/completions",
                "body": {"model": NAME, "prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 4}},
               {"custom_id": "unknown-model", "method": "POST", "url": "/v1/completions",
                "body": {"model": "nope", "prompt": "x", "max_tokens": 4}}]
    return completions + refused


async def interactive_answers(model_dir: str, requests: list[dict[str, Any]]) -> dict[str, tuple[int, dict]]:
    """Each request through the replica's HTTP edge in this process (its engine on one torch thread)."""
    config = EngineConfig(**ENGINE)
    thread = TorchThread(1)
    engine = await asyncio.wrap_future(thread.submit(functools.partial(build_engine, model=model_dir,
                                                                        engine_config=config, device="cpu")))
    host = EngineHost(engine, NAME, metrics=NullMetrics(), torch_thread=thread)
    try:
        settings = IngressSettings()
        send = in_process_send(build_api(edge_serving(host, settings), host.healthy, settings), lambda _: None, None)
        answers = await asyncio.gather(*(send(r["url"], r["body"], None) for r in requests))
    finally:
        host.stop()
    return {r["custom_id"]: a for r, a in zip(requests, answers, strict=True)}


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two runs of one request (its id and time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def refuse(endpoint: str, body: dict, owner: str | None) -> tuple[int, dict]:
    raise AssertionError("the replica's engine was asked for a line of a batch handed to Ray Data")


@pytest.mark.slow
def test_a_batch_handed_to_ray_data_gets_the_interactive_endpoints_answers(local_ray: None, model_dir: str,
                                                                           tmp_path: Path) -> None:
    requests = lines()
    files = FileStore(tmp_path)
    offline = OfflineBatches(spec(model_dir), min_lines=len(requests), num_cpus=ACTOR_CPUS)
    runner = BatchRunner(tmp_path, files, refuse, offline=offline.with_tenants(lambda _: None))
    upload = files.create(("\n".join(json.dumps(r) for r in requests) + "\n").encode(), "in.jsonl", "batch", None)
    batch = runner.create(upload.id, "/v1/completions", "24h", None, None)
    done = asyncio.run(runner.run(batch.id))
    assert done.status == "completed" and (done.completed, done.failed) == (6, 2)

    got = {}
    for file_id in (done.output_file_id, done.error_file_id):
        for raw in files.content(file_id, None).splitlines():
            line = json.loads(raw)
            got[line["custom_id"]] = (line["response"]["status_code"], line["response"]["body"])
    want = asyncio.run(interactive_answers(model_dir, requests))
    assert set(got) == set(want)
    for custom_id, (status, body) in want.items():
        assert got[custom_id][0] == status, (custom_id, got[custom_id], status, body)
        assert comparable(got[custom_id][1]) == comparable(body), custom_id
    assert want["long"][0] == 400 and want["unknown-model"][0] == 404
    assert all(want[f"c{i}"][1]["choices"][0]["text"] for i in range(6))


def test_only_tenants_without_quotas_and_a_cluster_that_holds_an_actor_are_handed_off(local_ray: None,
                                                                                    model_dir: str) -> None:
    tenants = {"free": Tenant("free", frozenset({"*"}), Limits()),
               "metered": Tenant("metered", frozenset({"*"}), Limits(tokens_per_minute=1000))}
    offline = OfflineBatches(spec(model_dir), min_lines=10, num_cpus=ACTOR_CPUS).with_tenants(tenants.get)
    assert offline.takes(None) and offline.takes("free")
    assert not offline.takes("metered")  # its quotas count in the replicas
    assert not offline.takes("gone")  # no longer in the keys file: the replicas answer each line 401
    assert not dataclasses.replace(offline, num_cpus=3.0).takes(None)  # the local Ray has 2 CPUs
    assert not dataclasses.replace(offline, num_gpus=1.0).takes(None)
