"""A Llama-family checkpoint end to end over HTTP: a tiny random Llama (saved with `transformers`)
with a Llama 3 style tokenizer, chat template and a multi-EOS generation config, behind a real
Ray Serve on loopback. Completions and chat, stream and not; prompt token counts equal
transformers'; generation stops on any of the generation config's eos ids."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.chat_tokenizers import STYLES, generation_eos_ids, write_chat_tokenizer
from tests.support.local_serve import SharedServe
from model import LLM, SamplingParams
from model.config import EngineConfig
from tests.support.tiny_models import torch_threads, write_tiny_llama
from tests.support.requirements import need_module

pytestmark = pytest.mark.slow
transformers = need_module("transformers")

VOCAB = 400
PROMPT = "The cat sat on the mat."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, list[int]]:
    """The checkpoint, plus the extra eos id and the greedy run that hits it: before serving,
    find what the model generates for PROMPT and make one of those tokens an eos id too."""
    root = tmp_path_factory.mktemp("llama")
    write_chat_tokenizer(root / "tok", "llama3", vocab_size=VOCAB)
    eos = generation_eos_ids(root / "tok", "llama3")
    bos = STYLES["llama3"]["special"].index("<|begin_of_text|>")  # specials take ids from 0 in order
    directory = write_tiny_llama(root / "tiny", arch="llama", with_tokenizer=False, vocab_size=VOCAB,
                                 max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos[-1])
    write_chat_tokenizer(directory, "llama3", vocab_size=VOCAB)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "top_k": 1}))
    llm = LLM(str(directory), device="cpu", engine_config=EngineConfig(kv_cache_memory_bytes=4 << 20))
    with torch_threads(1):  # as the replica (engine_num_cpus 1): a near-tie falls the same way there
        (free,) = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ids = free.token_ids
    k = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i] + eos)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [*eos, ids[k]], "top_k": 1}))
    return directory, k, ids


@pytest.fixture(scope="module")
def http(checkpoint: tuple[Path, int, list[int]], shared_serve: SharedServe) -> Iterator[httpx.Client]:
    directory = checkpoint[0]
    args = {"model": str(directory), "served_model_name": "tiny-llama", "max_num_seqs": 4, "num_kv_blocks": 64,
            "engine_num_cpus": 1}
    with shared_serve(args) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def hf(checkpoint: tuple[Path, int, list[int]]) -> Any:
    return transformers.AutoTokenizer.from_pretrained(checkpoint[0])


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_stops_on_a_generation_config_eos_id(http: httpx.Client, hf: Any,
                                                        checkpoint: tuple[Path, int, list[int]]) -> None:
    _, k, free = checkpoint
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()
    assert full["usage"]["prompt_tokens"] == len(hf(PROMPT)["input_ids"])  # BOS from the post-processor
    assert full["choices"][0]["finish_reason"] == "stop" and full["usage"]["completion_tokens"] == k + 1
    assert full["choices"][0]["text"] == hf.decode(free[:k], skip_special_tokens=True)
    chunks = _stream(http, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]
    assert chunks[-1]["usage"] == full["usage"]
    ignored = http.post("/v1/completions", json=body | {"ignore_eos": True}).json()
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 24


def test_chat_prompt_counts_like_transformers_and_stream_equals_non_stream(http: httpx.Client, hf: Any) -> None:
    body = {"model": "tiny-llama", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    full = http.post("/v1/chat/completions", json=body).json()
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert full["usage"]["prompt_tokens"] == len(want)
    assert http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == list(want)
    chunks = _stream(http, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    usage, first = dict(chunks[-1]["usage"]), dict(full["usage"])
    # The stream came second: the first request left the prompt's full KV blocks in the prefix cache.
    assert usage.pop("prompt_tokens_details")["cached_tokens"] == (len(want) - 1) // 16 * 16 > 0
    first.pop("prompt_tokens_details")
    assert usage == first


def test_generation_config_defaults_apply_to_unsent_fields(http: httpx.Client) -> None:
    """The config's top_k=1 makes a request that sends no top_k greedy, whatever its temperature."""
    greedy = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True}).json()
    default = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "n": 2,
                                                 "ignore_eos": True}).json()
    assert [c["text"] for c in default["choices"]] == [greedy["choices"][0]["text"]] * 2


def test_models_route(http: httpx.Client) -> None:
    card = http.get("/v1/models/tiny-llama").json()
    assert card["id"] == "tiny-llama" and card["max_model_len"] == 256
    assert http.get("/v1/models/other").status_code == 404
