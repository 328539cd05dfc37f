"""The shared KV tier across two engine replicas on real Ray Serve: a prompt computed by one
replica is answered by the other from the shared directory (cached tokens in its usage, the
tier's counter on Ray's metrics endpoint), with the same greedy text, each replica asked directly
on its own HTTP port (the ports HAProxy forwards to)."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.support.serve_fixtures import engine_replica_ports, scrape, serve_on_local_ray, wait_until, write_tiny_model

pytestmark = pytest.mark.slow

HTTP_PORT, DASHBOARD_PORT, METRICS_PORT = 18540, 18541, 18542
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
PROMPT = "A long shared system prompt that one replica computes and the other loads. " * 2


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    share = tmp_path_factory.mktemp("kv-share")
    args = {"model": str(model), "num_replicas": 2, "max_num_seqs": 4, "engine_num_cpus": 0.5,
            "router_num_cpus": 0.25, "torch_threads": 1, "kv_share_dir": str(share), "kv_share_bytes": 64 << 20}
    with serve_on_local_ray(args, HTTP_PORT, DASHBOARD_PORT, METRICS_PORT) as _:
        wait_until(lambda: len(engine_replica_ports()) == 2, 60, "HAProxy to list both engine replicas")
        yield engine_replica_ports()


def complete(port: int) -> dict[str, Any]:
    r = requests.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def loaded_blocks() -> float:
    return sum(v for n, _, v in scrape(METRICS_URL) if n == "ray_qkv_kv_share_loaded_blocks_total")


def test_a_prompt_computed_on_one_replica_is_loaded_by_the_other(ports: list[int]) -> None:
    first, second = ports
    a = complete(first)
    assert (a["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    # The first replica writes the prompt's blocks in the background: the second finds them once written.
    b: dict[str, Any] = {}
    wait_until(lambda: (b.update(complete(second)) or
                        b["usage"]["prompt_tokens_details"]["cached_tokens"] > 0), 30,
               "the second replica to find the prompt's blocks")
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] >= a["usage"]["prompt_tokens"] // 2
    wait_until(lambda: loaded_blocks() > 0, 60, "the shared tier's hits on Ray's metrics endpoint")
