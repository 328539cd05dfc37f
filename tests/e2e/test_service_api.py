"""The OpenAI-compatible API end to end: a real Ray Serve on loopback, the official `openai`
client, a tiny random-weight checkpoint (byte tokenizer, 256-token context), an API key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.local_serve import SharedServe, write_tiny_checkpoint

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[str]:
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", max_position=MAX_MODEL_LEN)
    # stream_interval_ms: every stream here carries several steps' tokens per message (the
    # other service tests stream one step per message, the default)
    args = {"model": str(ckpt), "served_model_name": MODEL, "api_key": API_KEY, "max_num_seqs": 8,
            "num_kv_blocks": 256, "engine_num_cpus": 1, "max_body_bytes": 64 * 1024, "stream_interval_ms": 40}
    with shared_serve(args) as url:
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
    # the tiny model takes a few ms a step: 40 ms merge several steps into one chunk
    assert len([c for c in chunks if c.choices]) < 24
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
    streamed, whole = chunks[-1].usage.model_dump(), full.usage.model_dump()
    # The second request finds the first one's full prompt blocks in the prefix cache.
    full_blocks = (whole["prompt_tokens"] - 1) // 16 * 16
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == full_blocks
    assert whole.pop("prompt_tokens_details")["cached_tokens"] in (0, full_blocks)
    assert streamed == whole


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


def test_echo_with_logprobs_returns_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "The cat sat on the mat"
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=prompt, echo=True, n=2, **kwargs)
    plain = client.completions.create(prompt=prompt, **kwargs).choices[0]
    n = len(prompt.encode())  # byte tokenizer
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text == prompt + plain.text
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 5
        assert "".join(lp.tokens[:n]) == prompt and lp.text_offset[:n] == list(range(n))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
        # The generated part is what the request without echo gets.
        assert lp.tokens[n:] == plain.logprobs.tokens
        assert lp.text_offset[n:] == [n + o for o in plain.logprobs.text_offset]
        assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    # Causal: a shorter prompt's logprobs are the first ones of the longer prompt's.
    short = client.completions.create(prompt=prompt[:10], echo=True, **kwargs).choices[0].logprobs
    assert short.token_logprobs[1:10] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:10], abs=1e-5)
    # Streamed: the echo chunk carries the prompt's logprobs, and everything adds up to the same.
    tokens, values = [], []
    for chunk in client.completions.create(prompt=prompt, echo=True, stream=True, **kwargs):
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            values += c.logprobs.token_logprobs if c.logprobs else []
    first = out.choices[0].logprobs
    assert tokens == first.tokens and values[0] is None
    assert values[1:] == pytest.approx(first.token_logprobs[1:], abs=1e-5)


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


def test_default_max_tokens_is_16_on_completions_and_the_context_on_chat(client: openai.OpenAI) -> None:
    # Completions: OpenAI's and vLLM's default of 16, clipped to the context that is left.
    out = client.completions.create(model=MODEL, prompt="a" * 100, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    near_full = client.completions.create(model=MODEL, prompt="a" * (MAX_MODEL_LEN - 5), temperature=0,
                                          extra_body={"ignore_eos": True})
    assert near_full.usage.completion_tokens == 5
    # Chat: the rest of the context, as OpenAI's chat does; max_completion_tokens is honoured.
    messages = [{"role": "user", "content": "a" * 150}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_MODEL_LEN - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length"
    capped = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=7,
                                            extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 7


def _usage_of(chunk: Any) -> tuple[int, int, int]:
    u = chunk.usage
    assert u is not None, chunk
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    return u.prompt_tokens, u.completion_tokens, u.total_tokens


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompts = ["ab", "cdef"]
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10, temperature=0.8,
                                            seed=3, stream=True, stream_options=options,
                                            extra_body={"ignore_eos": True}))
    *per_choice, last = chunks
    assert per_choice and all(len(c.choices) == 1 for c in per_choice)
    so_far: dict[int, int] = {}
    for chunk in per_choice:  # each choice's own prompt and its tokens so far, growing to the end
        index = chunk.choices[0].index
        prompt_tokens, completion_tokens, _ = _usage_of(chunk)
        assert prompt_tokens == len(prompts[index // 2])
        assert completion_tokens >= so_far.get(index, 1)
        so_far[index] = completion_tokens
    assert so_far == {0: 10, 1: 10, 2: 10, 3: 10}
    assert last.choices == [] and _usage_of(last) == (6, 40, 46)

    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=6, temperature=0, stream=True, stream_options=options,
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant" and _usage_of(chat[0])[1] == 0
    counts = [_usage_of(c)[1] for c in chat[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert {_usage_of(c)[0] for c in chat} == {chat[-1].usage.prompt_tokens}
    # Without the option only the last chunk carries usage.
    plain = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_logit_bias_steers_completions_and_chat(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="xyz", max_tokens=5, temperature=0,
                                    logit_bias={str(ord("Q")): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "QQQQQ"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=4,
                                          temperature=0, logit_bias={str(ord("z")): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "zzzz"


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
