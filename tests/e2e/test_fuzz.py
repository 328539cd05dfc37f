"""Property-based fuzzing of every route with hypothesis, against a real Ray Serve on loopback.

Random JSON documents as whole bodies, and valid bodies with random values (any JSON, NaN and
infinities included, and numbers near every bound) in any of the route's fields. Whatever is
sent, only a 2xx or a 4xx comes back, every 4xx has the OpenAI error shape, a 200 stream ends
with [DONE] and no error event, and the service stays healthy. Derandomized, so a failure
reproduces; the example counts keep the module at about a minute on two cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.serve_fixtures import write_tiny_model
from tests.support.local_serve import SharedServe

pytestmark = pytest.mark.slow

MODEL = "fuzz"
CHAT = [{"role": "user", "content": "hi"}]
FUZZ = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Valid bodies (short generations) and every field each route reads.
SAMPLING_FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options",
                   "presence_penalty", "frequency_penalty", "user", "top_k", "ignore_eos", "min_tokens",
                   "stop_token_ids", "repetition_penalty"]
ROUTES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/v1/completions": ({"prompt": "hello", "max_tokens": 4},
                        ["prompt", "logprobs", "echo", *SAMPLING_FIELDS]),
    "/v1/chat/completions": ({"messages": CHAT, "max_tokens": 4},
                             ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                              "add_generation_prompt", *SAMPLING_FIELDS]),
    "/tokenize": ({"prompt": "hello"}, ["model", "prompt", "messages", "add_generation_prompt"]),
    "/detokenize": ({"tokens": [104, 105]}, ["model", "tokens"]),
}

_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
            | st.sampled_from([0, 1, -1, 2, 16, 17, 20, 21, 255, 256, 257, 2**31, 2**63 - 1, 2**63, -2**63, 10**40,
                               0.0, 1e-39, 1.0, 2.0, 2.000001, -2.0000001, 1e308, "", MODEL, "/etc/passwd"]))
JSON = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)

# Values of the type a field expects, near and across its bounds, so that many requests get
# past validation and reach the engine.
_INT = st.integers(min_value=-3, max_value=300) | st.sampled_from([2**63 - 1, 2**63, 10**20, -2**63])
_FLOAT = st.floats(min_value=-3, max_value=3) | st.sampled_from([0.0, 1e-39, 1e-6, 2.0, 1e308, -0.0])
_TEXT = st.text(max_size=24)
_TOKENS = st.lists(st.integers(min_value=-1, max_value=300), max_size=8)
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot"]),
     "content": st.none() | _TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}),
                                            max_size=2)}), max_size=3)
_TYPED: dict[str, st.SearchStrategy[Any]] = {
    "prompt": _TEXT | st.lists(_TEXT, max_size=3) | _TOKENS | st.lists(_TOKENS, max_size=3),
    "messages": _MESSAGES, "tokens": _TOKENS, "stop_token_ids": _TOKENS,
    "stop": _TEXT | st.lists(_TEXT, max_size=9),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "model": st.sampled_from([MODEL, "", "other", "../" + MODEL]) | _TEXT, "user": _TEXT,
    "logprobs": st.booleans() | _INT,  # a count for completions, a flag for chat
    **dict.fromkeys(["stream", "echo", "ignore_eos", "add_generation_prompt"], st.booleans()),
    **dict.fromkeys(["max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "top_logprobs"],
                    _INT),
    **dict.fromkeys(["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"],
                    _FLOAT),
}


def _value(field: str) -> st.SearchStrategy[Any]:
    """Mostly a value of the field's type, sometimes any JSON at all."""
    typed = _TYPED[field]
    return st.one_of(typed, typed, typed, JSON)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[httpx.Client]:
    ckpt = write_tiny_model(tmp_path_factory.mktemp("ckpt") / MODEL)
    args = {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 16, "num_kv_blocks": 512,
            "engine_num_cpus": 1, "max_body_bytes": 64 * 1024}
    with shared_serve(args) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _send(http: httpx.Client, method: str, route: str, body: Any) -> None:
    """Send `body` (NaN and infinities as JSON extensions) and check the answer's contract."""
    content = json.dumps(body, allow_nan=True).encode()
    with http.stream(method, route, content=content, headers={"content-type": "application/json"}) as r:
        payload = r.read()
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, payload[:300])
    text = payload.decode()
    assert "Traceback" not in text and 'File "' not in text, text[:300]
    if r.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text[-300:]
    else:
        json.loads(text)


@pytest.mark.parametrize("route", list(ROUTES))
@FUZZ
@given(body=JSON)
def test_random_json_bodies(http: httpx.Client, route: str, body: Any) -> None:
    _send(http, "POST", route, body)


@pytest.mark.parametrize("route", list(ROUTES))
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_random_values_in_every_field(http: httpx.Client, route: str, data: st.DataObject) -> None:
    base, fields = ROUTES[route]
    names = data.draw(st.sets(st.sampled_from(fields), min_size=1, max_size=4))
    changed = {name: data.draw(_value(name), label=name) for name in sorted(names)}
    dropped = data.draw(st.sampled_from([None, None, None, *sorted(base)]), label="dropped")  # a required one, at times
    _send(http, "POST", route, {k: v for k, v in base.items() if k != dropped} | changed)


@pytest.mark.parametrize("route", ["/v1/models", "/health"])
@settings(FUZZ, max_examples=15)
@given(body=JSON, params=st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20), max_size=3))
def test_get_routes_ignore_what_they_are_sent(http: httpx.Client, route: str, body: Any,
                                              params: dict[str, str]) -> None:
    r = http.request("GET", route, params=params, content=json.dumps(body, allow_nan=True).encode())
    assert r.status_code == 200, r.text[:300]


# What the fuzz found once, kept as fixed cases: each used to kill the engine step.
FOUND = [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "top_k": 2**63}),
         ("/v1/completions", {"prompt": "x", "max_tokens": 4, "top_k": 10**20, "stream": True})]


@pytest.mark.parametrize(("route", "body"), FOUND)
def test_found_cases_are_a_400_and_the_engine_lives(http: httpx.Client, route: str, body: dict[str, Any]) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text[:300]
    assert http.get("/health").status_code == 200


def test_still_healthy_and_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
