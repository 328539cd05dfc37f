"""Faults, deadlines, slow clients and hostile input against a real Ray Serve on loopback.

One application for the module, with an API key, a whole-request deadline, small header and
body limits and the step-fault injector of tests/support/fault_injection.py. Its model is slow enough
(about a minute for 4,000 tokens on a CPU) that a long request is still running when the test
acts on it. The disruptive tests (a failing engine step, a killed replica) run last.

Bounds the tests state (hang bounds, far above the normal times): a request in flight when its
replica dies ends with an error, never with a client read that gave up after CLIENT_TIMEOUT_S;
the service answers again within RECOVERY_S; a stalled engine step fails /health within
STALL_TIMEOUT_S + STALL_DETECT_S.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from tests.support.serve_fixtures import REPO, health_status, sse_payloads, wait_until
from tests.support.local_serve import local_service, write_tiny_checkpoint

pytestmark = pytest.mark.slow

HTTP_PORT = 18340
MODEL = "rel"
API_KEY = "rel-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAULT_MARKER = "<<qkv-test-fault>>"
STALL_MARKER = "<<qkv-test-stall>>"
STALL_TIMEOUT_S = 8.0  # the app's stall_timeout_s: a step that long without progress is a stall
REQUEST_TIMEOUT_S = 15.0
MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
CLIENT_TIMEOUT_S = 60.0
STALL_DETECT_S = 60.0
RECOVERY_S = 90.0
LONG = {"prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}  # far past the deadline
REPLICA_PREFIX = "SERVE_REPLICA::qkv#EngineDeployment#"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, the served checkpoint directory)."""
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "rel", max_position=4096, d_model=512,
                                 n_heads=8, n_layers=4, d_ff=2048)
    args = {"model": str(ckpt), "served_model_name": MODEL, "api_key": API_KEY, "max_num_seqs": 8,
            "num_kv_blocks": 600, "engine_num_cpus": 1, "request_timeout_s": REQUEST_TIMEOUT_S,
            "max_header_bytes": MAX_HEADER_BYTES, "max_body_bytes": MAX_BODY_BYTES, "stall_timeout_s": STALL_TIMEOUT_S}
    # Its own Ray, not the session's shared one (tests/support/local_serve.py): it kills and wedges
    # replicas, and on the shared Ray, after seven other modules' apps, a killed replica's
    # non-streamed request once got a closed connection instead of a 5xx (not understood yet).
    with local_service(args, HTTP_PORT, num_cpus=2, step_fault_marker=FAULT_MARKER,
                       step_stall_marker=STALL_MARKER) as url:
        wait_until(lambda: health_status(url) == 200, 60, "the service to be healthy")
        yield url, ckpt


@pytest.fixture(scope="module")
def base_url(served: tuple[str, Path]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


# ---- helpers --------------------------------------------------------------------------------


def _stats() -> dict[str, Any]:
    handle = serve.get_deployment_handle("EngineDeployment", app_name="qkv")
    return handle.engine_stats.remote().result(timeout_s=30)


def _idle() -> bool:
    s = _stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]


def _engine_replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(REPLICA_PREFIX)}


def _assert_clean(text: str) -> None:
    """No stack trace and no path of this machine in what a client sees."""
    for leak in ("Traceback", 'File "', "site-packages", ".py\"", str(REPO), "/tmp/"):
        assert leak not in text, f"{leak!r} leaked: {text[:300]}"


def _assert_error(r: httpx.Response, status: int, code: str | None = None, clean: bool = True) -> dict[str, Any]:
    """The documented error shape; `clean=False` when the message echoes a path the client sent."""
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if clean:
        _assert_clean(r.text)
    return error


def _assert_stream_error(events: list[Any], code: str | None = None) -> dict[str, Any]:
    """A stream that ended with an `error` event and then [DONE], never with a finished choice."""
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    assert not any(isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices", []))
                   for e in events), "a request that failed reported a finish"
    _assert_clean(json.dumps(events[-2]))
    return error


def _stream_events(base_url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=CLIENT_TIMEOUT_S) as client, \
            client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        return r.status_code, sse_payloads(r.iter_lines())


def _assert_late_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """A non-streamed request that failed: with `status` when it failed before its response
    started, or as the error object in the body of a 200 that had started (service/server/api.py
    HeldResponse: a request still running half a second after its first token starts its
    response, then sends a space every quarter second, so that a client that leaves is noticed)."""
    if r.status_code != 200:
        return _assert_error(r, status, code)
    assert r.headers["content-type"] == "application/json", r.text[:300]  # spaces first, when it ran long enough
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    _assert_clean(r.text)
    return error


def _post(base_url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", json=body, headers=AUTH, timeout=CLIENT_TIMEOUT_S)


def _serves(http: httpx.Client) -> None:
    """Both kinds of request succeed, with exactly the tokens asked for."""
    body = {"prompt": "after", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text[:300]
    status, events = _stream_events(str(http.base_url), body | {"stream_options": {"include_usage": True}})
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8


# ---- security -------------------------------------------------------------------------------


UNSERVED_MODELS = ["/etc/passwd", "../", "../../../../etc/passwd", "rel/../rel", "transformer-base",
                   "file:///etc/passwd", "~/.ssh/id_rsa", "rel\x00", "REL"]


@pytest.mark.parametrize("model", UNSERVED_MODELS)
def test_no_request_picks_a_model_or_file_that_is_not_served(http: httpx.Client, served: tuple[str, Path],
                                                             model: str) -> None:
    replicas = _engine_replicas()
    routes = [("/v1/completions", {"prompt": "x", "max_tokens": 1}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
              ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]
    for route, body in routes:
        _assert_error(http.post(route, json=body | {"model": model}), 404, "model_not_found")
    # the served checkpoint's own directory is a path too, not the served name
    _assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "model": str(served[1])}),
                  404, "model_not_found", clean=False)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
    assert _engine_replicas() == replicas  # nothing was loaded or restarted


def test_file_names_in_prompts_are_only_text(http: httpx.Client) -> None:
    body = {"prompt": "/etc/passwd", "max_tokens": 4, "echo": True, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("/etc/passwd")
    assert "root:" not in r.text
    assert http.post("/tokenize", json={"prompt": "/etc/passwd"}).json()["count"] == len("/etc/passwd")


PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"), ("GET", "/docs"),
             ("GET", "/"), ("POST", "/v1/nothing"), ("GET", "/metrics"), ("GET", "/health/"),
             ("GET", "/v1/health"), ("OPTIONS", "/v1/completions"), ("HEAD", "/v1/models")]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_route_but_health_demands_the_key(base_url: str, method: str, path: str) -> None:
    body = {"prompt": "x", "max_tokens": 1} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}, {"X-API-Key": API_KEY}):
        r = httpx.request(method, f"{base_url}{path}", json=body, headers=headers, timeout=CLIENT_TIMEOUT_S)
        assert r.status_code == 401, (headers, r.status_code)
        if method != "HEAD":
            _assert_error(r, 401, "invalid_api_key")
    assert httpx.request(method, f"{base_url}{path}", json=body, headers=AUTH).status_code != 401


def test_health_is_open(base_url: str) -> None:
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_header_and_body_limits(http: httpx.Client, base_url: str) -> None:
    ok = {"prompt": "x", "max_tokens": 1}
    assert http.post("/v1/completions", json=ok, headers={"X-Pad": "a" * 4096}).status_code == 200
    _assert_error(http.post("/v1/completions", json=ok, headers={"X-Pad": "a" * MAX_HEADER_BYTES}), 431)
    many = {f"X-Pad-{i}": "a" * 500 for i in range(MAX_HEADER_BYTES // 500 + 1)}
    _assert_error(http.post("/v1/completions", json=ok, headers=many), 431)
    # More header lines than HAProxy parses (its tune.http.maxhdr, 101) stop there: a plain 400.
    lots = {f"X-Line-{i}": "a" for i in range(120)}
    assert http.post("/v1/completions", json=ok, headers=lots).status_code == 400
    _assert_error(http.get("/v1/models", params={"q": "a" * MAX_HEADER_BYTES}), 431)
    # the limit holds before the key is checked, and on the open route too
    _assert_error(httpx.get(f"{base_url}/health", headers={"X-Pad": "a" * MAX_HEADER_BYTES}), 431)
    _assert_error(http.post("/v1/completions", json=ok | {"prompt": "a" * MAX_BODY_BYTES}), 413)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b'{"prompt": {"$ref": "/etc/passwd"}}',
                                     b'{"prompt": "x", "max_tokens": 1e999}', b"[" * 5000 + b"]" * 5000])
def test_errors_carry_no_stack_trace_or_path(http: httpx.Client, content: bytes) -> None:
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    _assert_error(r, 400)


# ---- slow clients and deadlines -------------------------------------------------------------


def test_a_slow_reader_never_holds_back_the_engine(http: httpx.Client, base_url: str) -> None:
    """A client that stops reading its stream: others' requests are decoded meanwhile, and the
    engine finishes the slow one's tokens too without the client having read them."""
    slow_tokens, fast_requests, fast_tokens = 200, 4, 16
    body = {"prompt": "slow", "max_tokens": slow_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=CLIENT_TIMEOUT_S) as slow, \
            slow.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # then the slow client stops reading
        for i in range(fast_requests):
            fast = http.post("/v1/completions", json={"prompt": f"fast {i}", "max_tokens": fast_tokens,
                                                      "ignore_eos": True, "temperature": 0})
            assert fast.status_code == 200 and fast.json()["usage"]["completion_tokens"] == fast_tokens
        # every token of the slow stream was decoded while its client read one line
        wait_until(_idle, 60, "the engine to finish the unread stream")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    usage = json.loads(rest[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == slow_tokens
    assert not any('"error"' in line for line in rest)


def test_a_request_past_its_deadline_is_aborted_and_frees_its_blocks(base_url: str) -> None:
    assert _idle()
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(_post, base_url, LONG)
        status, events = _stream_with_blocks_held(base_url)
        r = plain.result()
    # 15 s after its first token: its response had started, so the 504 is the body of a 200
    assert r.status_code == 200
    _assert_late_error(r, 504, "request_timeout")
    assert status == 200 and any(e["choices"][0]["text"] for e in events[:-2]), "no tokens before the deadline"
    assert f"{REQUEST_TIMEOUT_S:g} s" in _assert_stream_error(events, "request_timeout")["message"]
    wait_until(_idle, 60, "the aborted requests' KV blocks to be freed")


def _stream_with_blocks_held(base_url: str) -> tuple[int, list[Any]]:
    """Stream LONG; while it runs, check that both long requests hold KV blocks."""
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=CLIENT_TIMEOUT_S) as client, \
            client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        events: list[Any] = []
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                break
        wait_until(lambda: _stats()["num_running"] == 2, 60, "both long requests to run")
        assert _stats()["num_free_blocks"] < _stats()["num_total_blocks"]
        for line in lines:
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.status_code, events


# ---- faults (last: they replace the engine replica) ------------------------------------------


def test_an_engine_step_exception_errors_the_batch_and_the_replica_is_replaced(http: httpx.Client,
                                                                               base_url: str) -> None:
    before = _engine_replicas()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_events, base_url, LONG)
        plain = pool.submit(_post, base_url, LONG)
        wait_until(lambda: _stats()["num_running"] == 2, 60, "two requests in the batch")
        marked = http.post("/v1/completions", json={"prompt": f"{FAULT_MARKER} go", "max_tokens": 4})
        status, events = streamed.result()
        r = plain.result()
    error = _assert_error(marked, 503)
    assert "replaced" in error["message"] and error["type"] == "server_error"
    _assert_late_error(r, 503)  # a 200 with the error when its response had started
    assert status == 200
    _assert_stream_error(events)
    wait_until(lambda: health_status(base_url) == 503, 60, "/health to report the dead engine")
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "a replacement replica")
    after = _engine_replicas()
    assert after and after.isdisjoint(before), (before, after)
    _serves(http)


def test_a_stalled_engine_step_fails_health_and_its_requests_and_the_replica_is_replaced(
        http: httpx.Client, base_url: str) -> None:
    before = _engine_replicas()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(_stream_events, base_url, LONG)
        wait_until(lambda: _stats()["num_running"] == 1, 60, "a request in the batch")
        assert health_status(base_url) == 200  # a busy engine is not a stalled one
        marked = pool.submit(_post, base_url, {"prompt": f"{STALL_MARKER} go", "max_tokens": 4})
        # The next step never returns; the loop thread lives on. Both the HTTP check and
        # Serve's check_health apply the same rule: no progress for STALL_TIMEOUT_S.
        wait_until(lambda: health_status(base_url) == 503, STALL_TIMEOUT_S + STALL_DETECT_S, "/health to report the stall")
        status, events = streamed.result()
        r = marked.result()
    error = _assert_error(r, 503)
    assert "progress" in error["message"] and "retry" in error["message"]
    assert status == 200
    _assert_stream_error(events)
    wait_until(lambda: (after := _engine_replicas()) and after.isdisjoint(before), RECOVERY_S,
               "Serve to replace the stalled replica (its check_health fails)")
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "the service to answer again")
    _serves(http)


def test_killing_the_engine_replica_fails_in_flight_requests_then_recovers(http: httpx.Client,
                                                                          base_url: str) -> None:
    """The replica is the HTTP server: its requests end with it. A request whose response had not
    started gets a 5xx (HAProxy's 502/503, or the dying server's 500); a stream already started
    is cut short, so the client sees a broken stream (no [DONE], no finish), never a hang or a
    finished-looking answer; so is a non-streamed answer whose response had started (a held
    response: service/server/api.py), whose body then ends before its JSON."""
    (victim,) = _engine_replicas()
    count = 6

    def stream(body: dict[str, Any]) -> tuple[int, list[Any]] | Exception:
        try:
            return _stream_events(base_url, body)
        except httpx.HTTPError as exc:  # the connection was cut mid-stream
            return exc

    def post(body: dict[str, Any]) -> httpx.Response | Exception:
        try:
            return _post(base_url, body)
        except httpx.HTTPError as exc:  # a held response cut before its body
            return exc

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(stream, LONG) if i % 2 else pool.submit(post, LONG) for i in range(count)]
        wait_until(lambda: _stats()["num_running"] == count, 60, f"{count} requests in the batch")
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        outcomes = [f.result() for f in futures]  # each read gives up after CLIENT_TIMEOUT_S: no hang
    # Each ended with the replica, not by the client giving up (an httpx.ReadTimeout is neither
    # of the errors allowed below) nor by running to its end (a finish or [DONE]).
    for outcome in outcomes:
        if isinstance(outcome, httpx.Response):
            assert 500 <= outcome.status_code < 600, outcome.text[:300]
        elif isinstance(outcome, Exception):
            assert isinstance(outcome, (httpx.RemoteProtocolError, httpx.ReadError)), repr(outcome)
        else:
            status, events = outcome
            assert status == 200 and "[DONE]" not in events, events[-3:]
            assert not any(isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices", []))
                           for e in events), "a request that was cut off reported a finish"
    # ray.kill returns before the actor is gone: the victim may still answer /health for a moment,
    # so wait for its replacement first, then for the service.
    wait_until(lambda: (after := _engine_replicas()) and victim not in after, RECOVERY_S,
               "Serve to replace the killed replica")
    wait_until(lambda: health_status(base_url) == 200, RECOVERY_S, "the service to answer again")
    _serves(http)
    wait_until(_idle, 60, "the new replica to be idle")

