"""Tenants' limits hold across two engine replicas on real Ray Serve: each replica is asked
directly on its own HTTP port (the ports HAProxy forwards to), with the official `openai` client,
and the one ledger counts for both: a tenant's requests per minute and its requests in flight are
refused on one replica for what it did on the other (429, Retry-After, the OpenAI error shape),
another tenant is not, and the per-tenant counters reach Ray's metrics endpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.serve_fixtures import engine_replica_ports, scrape, serve_on_local_ray, wait_until, write_tiny_model
from service.tenancy.keys import hash_key

pytestmark = pytest.mark.slow

HTTP_PORT, DASHBOARD_PORT, METRICS_PORT = 18550, 18551, 18552
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
KEYS = f"""
tenants:
  team-a:
    keys: ["{hash_key('key-a')}"]
    requests_per_minute: 3
  team-b:
    keys: ["{hash_key('key-b')}"]
    max_concurrency: 1
  team-c:
    keys: ["{hash_key('key-c')}"]
"""


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS)
    args = {"model": str(model), "num_replicas": 2, "max_num_seqs": 4, "engine_num_cpus": 0.5,
            "router_num_cpus": 0.25, "torch_threads": 1, "api_keys_file": str(keys)}
    with serve_on_local_ray(args, HTTP_PORT, DASHBOARD_PORT, METRICS_PORT) as _:
        wait_until(lambda: len(engine_replica_ports()) == 2, 60, "HAProxy to list both engine replicas")
        yield engine_replica_ports()


def client(port: int, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def complete(port: int, key: str, max_tokens: int = 2) -> Any:
    return client(port, key).completions.create(model="tiny", prompt="hello", max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True})


def tenant_samples(name: str, tenant: str) -> float:
    return sum(v for n, labels, v in scrape(METRICS_URL) if n == name and labels.get("tenant") == tenant)


def test_requests_per_minute_count_across_replicas(ports: list[int]) -> None:
    first, second = ports
    for port in (first, second, first):
        assert complete(port, "key-a").usage.completion_tokens == 2
    with pytest.raises(openai.RateLimitError) as err:
        complete(second, "key-a")  # the fourth in a minute, on the replica that saw only one
    assert err.value.body["code"] == "rate_limit_exceeded" and "requests per minute" in err.value.body["message"]
    assert 1 <= int(err.value.response.headers["Retry-After"]) <= 60
    assert complete(second, "key-c").usage.completion_tokens == 2  # another tenant is not limited
    with pytest.raises(openai.AuthenticationError):
        complete(first, "key-unknown")
    wait_until(lambda: tenant_samples("ray_qkv_tenant_rejections_total", "team-a") >= 1, 40,
               "the tenant's rejection on Ray's metrics endpoint")
    wait_until(lambda: tenant_samples("ray_qkv_tenant_generation_tokens_total", "team-a") >= 6, 40,
               "the tenant's generated tokens on Ray's metrics endpoint")


def test_a_request_in_flight_on_one_replica_holds_the_tenants_concurrency_on_the_other(ports: list[int]) -> None:
    first, second = ports
    started, done = threading.Event(), threading.Event()
    text: list[str] = []

    def long_stream() -> None:
        stream = client(first, "key-b").completions.create(model="tiny", prompt="hello", max_tokens=200,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            started.set()
            text.append(chunk.choices[0].text if chunk.choices else "")
        done.set()

    worker = threading.Thread(target=long_stream, daemon=True)
    worker.start()
    assert started.wait(60), "the long stream did not start"
    with pytest.raises(openai.RateLimitError) as err:
        complete(second, "key-b")
    assert "requests in flight" in err.value.body["message"]
    assert done.wait(120) and len("".join(text)) > 0
    # Released by the first replica's next report: the tenant is admitted again, here or there.
    deadline = time.monotonic() + 60  # a hang bound: the next report normally comes within a second
    while True:
        try:
            assert complete(second, "key-b").usage.completion_tokens == 2
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the finished request's lease was never given back"
            time.sleep(0.2)
    worker.join(5)


def test_the_keys_file_is_checked_before_the_app_is_built(tmp_path: Path) -> None:
    from service.app import AppArgs

    (tmp_path / "bad.yaml").write_text("tenants: {a: {keys: [\"not-a-hash\"]}}")
    with pytest.raises(ValueError, match="keys"):
        AppArgs(model="transformer-base", api_keys_file=str(tmp_path / "bad.yaml"))
