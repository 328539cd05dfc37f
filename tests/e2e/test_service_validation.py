"""Bad requests get the documented status and the OpenAI error shape, never a 422 or a 500,
and the service stays healthy. A real Ray Serve on loopback with a tiny checkpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.local_serve import SharedServe, write_tiny_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_BODY = 16 * 1024
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[httpx.Client]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=MAX_MODEL_LEN)
    args = {"model": str(ckpt), "served_model_name": MODEL, "max_num_seqs": 8, "num_kv_blocks": 256,
            "engine_num_cpus": 1, "max_body_bytes": MAX_BODY}
    with shared_serve(args) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 4} | fields


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": CHAT, "max_tokens": 4} | fields


# (route, body, status, param, words the message must contain)
CASES = [
    ("/v1/completions", _cmpl(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("/v1/completions", _cmpl(max_tokens=-3), 400, "max_tokens", ">= 1"),
    ("/v1/completions", _cmpl(max_tokens=1.5), 400, "max_tokens", "integer"),
    ("/v1/completions", _cmpl(max_tokens="ten"), 400, "max_tokens", "integer"),
    ("/v1/completions", _cmpl(temperature=-0.1), 400, "temperature", ">= 0"),
    ("/v1/completions", _cmpl(temperature=2.5), 400, "temperature", "<= 2"),
    ("/v1/completions", _cmpl(temperature="hot"), 400, "temperature", "number"),
    ("/v1/completions", _cmpl(top_p=0), 400, "top_p", "> 0"),
    ("/v1/completions", _cmpl(top_p=1.5), 400, "top_p", "<= 1"),
    ("/v1/completions", _cmpl(top_k=-2), 400, "top_k", ">= -1"),
    ("/v1/completions", _cmpl(n=0), 400, "n", ">= 1"),
    ("/v1/completions", _cmpl(n=17), 400, "n", "<= 16"),
    ("/v1/completions", _cmpl(n=16, prompt=["a"] * 8), 400, "n", "at most 64"),
    ("/v1/completions", _cmpl(seed=-1), 400, "seed", ">= 0"),
    ("/v1/completions", _cmpl(seed="x"), 400, "seed", "integer"),
    ("/v1/completions", _cmpl(stream="yes"), 400, "stream", "boolean"),
    ("/v1/completions", _cmpl(stream_options={"include_usage": "y"}), 400, "stream_options.include_usage",
     "boolean"),
    ("/v1/completions", _cmpl(stop=[str(i) for i in range(9)]), 400, "stop", "at most 8"),
    ("/v1/completions", _cmpl(stop=[""]), 400, "stop", "empty"),
    ("/v1/completions", _cmpl(stop=5), 400, "stop", "string"),
    ("/v1/completions", _cmpl(logprobs=21), 400, "logprobs", "<= 20"),
    ("/v1/completions", _cmpl(logprobs=-1), 400, "logprobs", ">= 0"),
    ("/v1/completions", _cmpl(presence_penalty=2.5), 400, "presence_penalty", "<= 2"),
    ("/v1/completions", _cmpl(frequency_penalty=-3), 400, "frequency_penalty", ">= -2"),
    ("/v1/completions", _cmpl(repetition_penalty=0), 400, "repetition_penalty", "> 0"),
    ("/v1/completions", _cmpl(repetition_penalty=3), 400, "repetition_penalty", "<= 2"),
    ("/v1/completions", _cmpl(min_tokens=-1), 400, "min_tokens", ">= 0"),
    ("/v1/completions", _cmpl(min_tokens=5, max_tokens=2), 400, "min_tokens", "max_tokens=2"),
    ("/v1/completions", _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids[0]", ">= 0"),
    ("/v1/completions", _cmpl(stop_token_ids="x"), 400, "stop_token_ids", "array"),
    ("/v1/completions", _cmpl(stop_token_ids=[258], min_tokens=2), 400, "stop_token_ids", "0..257"),
    ("/v1/completions", _cmpl(stop_token_ids=[2**70]), 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", _cmpl(ignore_eos="no"), 400, "ignore_eos", "boolean"),
    # stream_options only with stream: true (OpenAI and vLLM)
    ("/v1/completions", _cmpl(stream_options={"include_usage": True}), 400, "stream_options",
     "stream_options can only be set when stream is true"),
    ("/v1/completions", _cmpl(stream=False, stream_options={}), 400, "stream_options", "only be set when stream"),
    ("/v1/chat/completions", _chat(stream_options={"include_usage": True}), 400, "stream_options",
     "stream_options can only be set when stream is true"),
    # fields that change the request's meaning and are not implemented: never dropped silently
    ("/v1/completions", _cmpl(suffix="tail"), 400, "suffix", "not supported"),
    ("/v1/completions", _cmpl(best_of=3), 400, "best_of", "best_of > n is not supported"),
    ("/v1/completions", _cmpl(best_of=1, n=2), 400, "best_of", "best_of must be >= n"),
    ("/v1/completions", _cmpl(min_p=0.1), 400, "min_p", "not supported"),
    ("/v1/completions", _cmpl(use_beam_search=True), 400, "use_beam_search", "not supported"),
    ("/v1/completions", _cmpl(prompt_logprobs=1), 400, "prompt_logprobs", "not supported"),
    ("/v1/completions", _cmpl(include_stop_str_in_output=True), 400, "include_stop_str_in_output", "not supported"),
    ("/v1/chat/completions", _chat(echo=True), 400, "echo", "not supported"),
    ("/v1/chat/completions", _chat(modalities=["text", "audio"]), 400, "modalities", "not supported"),
    ("/v1/chat/completions", _chat(bad_words=["x"]), 400, "bad_words", "not supported"),
    # logit_bias: token id keys in the vocabulary, values in [-100, 100]
    ("/v1/completions", _cmpl(logit_bias={"abc": 1}), 400, "logit_bias", "token ids"),
    ("/v1/completions", _cmpl(logit_bias={"5": 101}), 400, "logit_bias.5", "<= 100"),
    ("/v1/completions", _cmpl(logit_bias={"5": "up"}), 400, "logit_bias.5", "number"),
    ("/v1/completions", _cmpl(logit_bias={"258": 1}), 400, "logit_bias", "token id 258 in logit_bias"),
    ("/v1/chat/completions", _chat(logit_bias={"1000": -1}), 400, "logit_bias", "0..257"),
    ("/v1/completions", _cmpl(user="u" * 300), 400, "user", "256"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "required"),
    ("/v1/completions", _cmpl(prompt=[]), 400, "prompt", "string"),
    ("/v1/completions", _cmpl(prompt=""), 400, "prompt", "prompt must not be empty"),
    ("/v1/completions", _cmpl(prompt=[[]]), 400, "prompt", "empty"),
    ("/v1/completions", _cmpl(prompt=[1, "a"]), 400, "prompt", "token ids"),
    ("/v1/completions", _cmpl(prompt=[1, True]), 400, "prompt", "token ids"),
    ("/v1/completions", _cmpl(prompt=[5, 999]), 400, "prompt", "999"),
    ("/v1/completions", _cmpl(prompt=["a"] * 33), 400, "prompt", "at most 32"),
    ("/v1/completions", _cmpl(prompt="a" * 300), 400, "prompt",
     "This model's maximum context length is 256 tokens. However, you requested 304 tokens "
     "(300 in the prompt, 4 in the completion)."),
    ("/v1/completions", _cmpl(prompt="a" * 10, max_tokens=250), 400, "prompt",
     "However, you requested 260 tokens (10 in the prompt, 250 in the completion)."),
    ("/v1/completions", _cmpl(prompt="a" * 256, max_tokens=None), 400, "prompt", "256 in the prompt"),
    ("/v1/completions", _cmpl(model="gpt-4"), 404, "model", "gpt-4"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "required"),
    ("/v1/chat/completions", _chat(messages=[]), 400, "messages", "at least 1"),
    ("/v1/chat/completions", _chat(messages="hi"), 400, "messages", "array"),
    ("/v1/chat/completions", _chat(messages=[{"role": "bot", "content": "x"}]), 400, "messages[0].role", "bot"),
    ("/v1/chat/completions", _chat(messages=[{"content": "x"}]), 400, "messages[0].role", "required"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user"}]), 400, "messages[0]", "content"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content",
     "string"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content", "image_url"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), 400,
     "messages[0].content", "text and image_url parts"),
    ("/v1/chat/completions", _chat(messages=["hi"]), 400, "messages[0]", "object"),
    ("/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", "<= 20"),
    ("/v1/chat/completions", _chat(max_completion_tokens=0), 400, "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a" * 300}]), 400, "messages",
     "maximum context length is 256 tokens"),
    ("/v1/chat/completions", _chat(model="other"), 404, "model", "other"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, None, "exactly one"),
    ("/detokenize", {"tokens": [300]}, 400, "tokens", "300"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", ">= 0"),
]


def _check_error(r: httpx.Response, status: int, param: str | None, words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert words in body["error"]["message"]
    assert "Traceback" not in r.text and len(r.content) < 2048


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_field(http: httpx.Client, route: str, body: dict[str, Any], status: int, param: str | None,
                   words: str) -> None:
    body = {k: v for k, v in body.items() if v is not None}
    _check_error(http.post(route, json=body), status, param, words)


@pytest.mark.parametrize("stream", [False, True])
def test_errors_come_before_a_stream_starts(http: httpx.Client, stream: bool) -> None:
    _check_error(http.post("/v1/completions", json=_cmpl(temperature=9, stream=stream)), 400, "temperature", "<=")


@pytest.mark.parametrize(("content", "words"), [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"prompt"', "JSON object"),
    ("{\"prompt\": \"\udc80\"}".encode("utf-8", "surrogatepass"), "not valid JSON"),
])
def test_malformed_json(http: httpx.Client, content: bytes, words: str) -> None:
    r = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    _check_error(r, 400, None, words)


def test_body_too_large(http: httpx.Client) -> None:
    _check_error(http.post("/v1/completions", json=_cmpl(prompt="a" * MAX_BODY)), 413, None, str(MAX_BODY))

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted while reading
        yield json.dumps(_cmpl(prompt="a" * MAX_BODY)).encode()

    _check_error(http.post("/v1/completions", content=chunks()), 413, None, str(MAX_BODY))


BIG_BODY = 20 << 20  # far over MAX_BODY, and over what socket buffers absorb


def test_a_client_that_writes_the_whole_body_before_reading_gets_the_413(http: httpx.Client) -> None:
    """urllib writes all of a 20 MB body before it reads anything: the server must still let it
    read the 413 (it used to see a connection reset)."""
    body = json.dumps(_cmpl(prompt="a" * BIG_BODY)).encode()
    request = urllib.request.Request(str(http.base_url).rstrip("/") + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 413
    error = json.loads(err.value.read())["error"]
    assert str(MAX_BODY) in error["message"] and error["code"] == "request_too_large"
    # httpx (and its streaming upload without Content-Length) get it as well.
    _check_error(http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
                 413, None, str(MAX_BODY))
    _check_error(http.post("/v1/completions", content=iter([body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)])),
                 413, None, str(MAX_BODY))
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _check_error(http.post("/v1/nothing", json={}), 404, None, "Not Found")
    _check_error(http.get("/v1/completions"), 405, None, "Method Not Allowed")


def test_neutral_values_and_unknown_fields_are_accepted(http: httpx.Client) -> None:
    neutral = {"suffix": "", "best_of": 2, "n": 2, "min_p": 0, "use_beam_search": False, "stream_options": None,
               "logit_bias": {}, "a_field_nobody_knows": {"x": 1}, "metadata": {"k": "v"}, "store": False}
    r = http.post("/v1/completions", json=_cmpl(**neutral))
    assert r.status_code == 200, r.text
    chat = http.post("/v1/chat/completions", json=_chat(echo=False, modalities=["text"], service_tier="auto"))
    assert chat.status_code == 200, chat.text


def test_service_is_healthy_afterwards(http: httpx.Client) -> None:
    for case in CASES[:5]:
        http.post(case[0], json=case[1])
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json=_cmpl(max_tokens=3, ignore_eos=True))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
