"""Redeploys of the running service (`serve.run` of a changed config, what `serve deploy` does)
and a queue sized by the docs' rule: a real Ray Serve on loopback, apart from test_service_load.py
because a redeploy changes the config its tests need. Both tests pass in either order."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from service.app import AppArgs, build_app
from tests.support.bursts import burst
from tests.support.local_serve import local_service, write_tiny_checkpoint
from tests.support.polling import wait_until

pytestmark = pytest.mark.slow

HTTP_PORT = 18332
MODEL = "slow"
MAX_ONGOING = 2
BURST = 16  # concurrent clients of the queue test, and its queue


@pytest.fixture(scope="module")
def app_args(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "slow", max_position=4096, d_model=512,
                                 n_heads=8, n_layers=4, d_ff=2048)
    return {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 4, "num_kv_blocks": 1100,
            "engine_num_cpus": 1, "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": BURST}


@pytest.fixture(scope="module")
def base_url(app_args: dict[str, Any]) -> Iterator[str]:
    with local_service(app_args, HTTP_PORT, num_cpus=2) as url:
        yield url


def _wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    wait_until(check, timeout_s, what, every_s=0.25)


def _idle() -> bool:
    stats = serve.get_deployment_handle("EngineDeployment", app_name="qkv").engine_stats.remote().result()
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


# Long enough that the new replica starts and serves while the old one drains them (checked
# after the loop). `serve.run` returns only once the old replica has drained, so the streams'
# length is the test's: 2000 tokens took 78-98 s here, 1000 take ~35 s.
STREAM_TOKENS = 1000
SHORT = {"prompt": "during", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def _stream_tokens(base_url: str, body: dict[str, Any],
                   started: threading.Event | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Status and the JSON events of a stream with usage; raises if [DONE] is missing.
    `started` is set once the first event has arrived."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with httpx.Client(base_url=base_url, timeout=120) as http, http.stream("POST", "/v1/completions",
                                                                         json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                if started is not None:
                    started.set()
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    return r.status_code, [json.loads(x) for x in lines[:-1]]


def _assert_complete(status: int, events: list[dict[str, Any]], tokens: int) -> None:
    assert status == 200 and not any("error" in e for e in events), events[-2:]
    assert events[-1]["usage"]["completion_tokens"] == tokens
    assert [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]] == ["length"]


def _engine_replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::qkv#EngineDeployment#")}


def test_a_redeploy_while_streaming_completes_every_request(base_url: str, app_args: dict[str, Any]) -> None:
    """`serve.run` of a changed config (what `serve deploy` does) while streams run: the old
    replica stops taking requests and drains its streams to the end (graceful_shutdown_timeout_s),
    new requests go to the new replica, and no client sees an error."""
    _wait_for(_idle, "an idle engine", timeout_s=60)
    old = _engine_replicas()
    long_body = {"prompt": "in flight", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0}
    # The new config: another served name (visible in /v1/models), and half a CPU, so that the new replica fits next to the draining one on this 2-CPU Ray
    # (Serve starts it while the old one drains; without room it would wait for the drain).
    new_args = app_args | {"served_model_name": f"{MODEL}-v2", "engine_num_cpus": 0.5}
    with ThreadPoolExecutor(MAX_ONGOING + 1) as pool:
        # Both of the old replica's slots (MAX_ONGOING) go to the streams, so while they run, a
        # request that is answered was answered by the new replica.
        started = [threading.Event() for _ in range(MAX_ONGOING)]
        streams = [pool.submit(_stream_tokens, base_url, long_body, ev) for ev in started]
        _wait_for(lambda: all(ev.is_set() for ev in started), "the streams to run")
        redeploy = pool.submit(serve.run, build_app(AppArgs.model_validate(new_args)), name="qkv", route_prefix="/")
        both_alive_while_streaming, served_while_draining, during = False, 0, 0
        while not redeploy.done() or during < 2:  # new requests all along, and a couple after
            body = SHORT | {"prompt": f"during {during}"}
            if during % 2:
                _assert_complete(*_stream_tokens(base_url, body), 8)
            else:
                r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text[:300]
            replicas = _engine_replicas()
            if not any(s.done() for s in streams):
                served_while_draining += 1
                both_alive_while_streaming |= bool(replicas & old) and bool(replicas - old)
            if redeploy.done():
                during += 1
        redeploy.result()
        for stream in streams:
            _assert_complete(*stream.result(), STREAM_TOKENS)
    assert both_alive_while_streaming and served_while_draining, (
        "the redeploy did not overlap the streams (old and new replica alive while they ran, new "
        "requests answered meanwhile): make the streams longer")
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [f"{MODEL}-v2"]
    _wait_for(lambda: _engine_replicas().isdisjoint(old) and len(_engine_replicas()) == 1,
              "the old replica to be gone", timeout_s=60)


def test_a_queue_sized_by_the_readme_rule_takes_theburst(base_url: str) -> None:
    """docs/load-tests.md: max_queued_requests >= the client's concurrency. The burst that
    test_service_load.py's overload test sheds (BURST clients at once, a queue of 2) completes on
    this service, whose queue is BURST, before or after the redeploy (which keeps it)."""
    body = {"prompt": "abc", "max_tokens": 16, "ignore_eos": True, "stream": True}
    events = burst(base_url, body, BURST)
    assert [status for _, status, _ in events] == [200] * BURST, [i["body"][:200] for _, s, i in events if s != 200]
    for _, _, info in events:
        assert info["body"].endswith(b"data: [DONE]\n\n") and b'"finish_reason": "length"' in info["body"]
