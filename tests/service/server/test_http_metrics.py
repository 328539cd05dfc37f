"""The edge's response counter (`qkv_http_responses_total`, service/server/api.py `ResponseCounter`):
each response is recorded once, under the route template it matched and its status code, the
middlewares' own answers (401, 431) and unmatched paths (`other`) included."""

from __future__ import annotations

from fastapi.testclient import TestClient

from model.loading.tokenizer import ByteTokenizer
from service.server.api import IngressSettings, build_api
from tests.support.ingress_stub import stub_ingress


def test_every_response_is_counted_by_route_template_and_status() -> None:
    _, _, serving = stub_ingress(ByteTokenizer())
    seen: list[tuple[str, int]] = []
    settings = IngressSettings(api_key="k", max_header_bytes=2048)
    client = TestClient(build_api(serving, lambda: True, settings, on_response=lambda r, s: seen.append((r, s))))
    auth = {"Authorization": "Bearer k"}
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers=auth).status_code == 400
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True},
                       headers=auth) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    assert client.get("/v1/models/tiny", headers=auth).status_code == 200
    assert client.get("/v1/models/nope", headers=auth).status_code == 404
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert client.get("/nowhere", headers=auth).status_code == 404
    assert client.get("/health", headers={**auth, "X-Big": "x" * 4096}).status_code == 431
    assert seen == [("/v1/completions", 200), ("/v1/completions", 400), ("/v1/completions", 200),
                    ("/v1/models/{model_id:path}", 200), ("/v1/models/{model_id:path}", 404),
                    ("other", 401), ("other", 404), ("other", 431)]


def test_a_failing_recorder_does_not_fail_the_response() -> None:
    _, _, serving = stub_ingress(ByteTokenizer())

    def broken(route: str, status: int) -> None:
        raise RuntimeError("metrics agent gone")

    client = TestClient(build_api(serving, lambda: True, IngressSettings(), on_response=broken))
    assert client.get("/health").status_code == 200
