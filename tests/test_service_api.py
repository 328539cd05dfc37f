"""The OpenAI-compatible API end to end: a real Ray Serve on loopback, the official `openai`
client, a tiny random-weight checkpoint (byte tokenizer, 256-token context), an API key."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from local_serve import local_service, write_tiny_checkpoint

pytestmark = pytest.mark.slow

HTTP_PORT = 18310
API_KEY = "test-key-123"
MODEL = "tiny"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=MAX_MODEL_LEN)
    args = {"model": str(ckpt), "served_model_name": MODEL, "api_key": API_KEY, "max_num_seqs": 8,
            "num_kv_blocks": 256, "engine_num_cpus": 1, "max_body_bytes": 64 * 1024}
    with local_service(args, HTTP_PORT, num_cpus=2) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _count_tokens(http: httpx.Client, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


# ---- completions and chat through the openai client ----------------------------------------


def test_completion_stream_equals_non_stream_and_usage_is_exact(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "The cat sat on"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == _count_tokens(http, prompt) == len(prompt.encode())
    assert full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_prompt_is_the_default_template(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    rendered = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(rendered.encode())
    assert http.post("/tokenize", json={"messages": messages}).json()["count"] == len(rendered.encode())


def test_n_choices_and_seeds(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                  extra_body={"ignore_eos": True})
    many = client.completions.create(n=3, seed=5, **kwargs)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    texts = {c.index: c.text for c in many.choices}
    assert len(set(texts.values())) > 1  # seeds 5, 6, 7 sample differently
    again = client.completions.create(seed=5, **kwargs).choices[0].text
    assert again == texts[0] == client.completions.create(seed=5, **kwargs).choices[0].text
    assert client.completions.create(seed=6, **kwargs).choices[0].text == texts[1]
    assert many.usage.completion_tokens == 3 * 16


def test_streamed_n_choices_match_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=8, temperature=0.8, seed=11)
    full = client.completions.create(**kwargs)
    assert len(full.choices) == 4
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in full.choices}


def test_logprobs_stop_and_echo(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6
    assert all(len(top) >= 1 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    text = out.choices[0].text
    stop = text[2:4]
    stopped = client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    echoed = client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "xyz" + text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)


def test_token_id_prompts_and_default_model(http: httpx.Client) -> None:
    ids = list(b"hello")
    by_ids = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0}).json()
    by_text = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                 "model": MODEL, "unknown_field": 1}).json()
    assert by_ids["model"] == MODEL
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello"}


def test_max_tokens_defaults_to_the_rest_of_the_context(http: httpx.Client) -> None:
    body = http.post("/v1/completions", json={"prompt": "a" * 200, "temperature": 0, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - 200
    assert body["choices"][0]["finish_reason"] == "length"


def test_models_and_health(http: httpx.Client, base_url: str) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(f"{base_url}/health")  # no key needed
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# ---- authentication -----------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_required(base_url: str, headers: dict[str, str]) -> None:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="nope", max_retries=0).models.list()
