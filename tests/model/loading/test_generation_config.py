"""generation_config.json as vLLM reads it: every EOS id (int or list) ends generation, and its
sampling defaults apply to what a request leaves unset (offline: `LLM.get_default_sampling_params`
and `generate` without params; HTTP: the fields a request did not send). Special tokens come
from one place, the tokenizer."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.support.ingress_stub import stub_ingress
from model import LLM, PRESETS, ModelConfig, SamplingParams
from model.config import BYTE_EOS_ID, EngineConfig, RuntimeInfo
from model.loading.generation_config import GenerationConfig, load_generation_config
from model.loading.tokenizer import ByteTokenizer, load_tokenizer
from tests.support.tiny_models import save_tiny_gpt2

ENGINE = EngineConfig(kv_cache_memory_bytes=4 << 20)
PROMPT = "The cat sat on"


def _write(directory: Path, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 with a BPE tokenizer (its greedy text varies, unlike the presets')."""
    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny"))


def _copy_checkpoint(src: Path, dst: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (dst / name).write_bytes((src / name).read_bytes())


@pytest.fixture(scope="module")
def free_run(ckpt: Path) -> list[int]:
    """What the checkpoint generates greedily when nothing stops it."""
    (out,) = LLM(str(ckpt), device="cpu", dtype="float32", engine_config=ENGINE).generate(
        PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    return out.token_ids


def test_eos_ids_int_list_and_config_json_fallback(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {"eos_token_id": 7, "bos_token_id": 1})
    assert load_generation_config(tmp_path) == GenerationConfig((7,), 1)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [9, 7, 9], "temperature": 0.6, "top_p": 0.9,
                                                "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
                                                "max_new_tokens": 5})
    gen = load_generation_config(tmp_path)
    assert gen.eos_token_ids == (9, 7) and gen.bos_token_id == 1  # bos from config.json
    assert gen.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    _write(tmp_path, "generation_config.json", {"temperature": 5.0, "top_p": 0.5})
    assert load_generation_config(tmp_path).sampling_defaults == {"top_p": 0.5}  # a bad default is dropped
    # The byte tokenizer of such a checkpoint: its own <eos> first, then the config's.
    assert load_tokenizer(tmp_path, 300).eos_token_ids == (BYTE_EOS_ID, 7)


def test_eos_and_bos_have_one_source() -> None:
    """Issue 14: the gpt2-small-random preset declared eos 50256 while its tokenizer ends on 256;
    now neither ModelConfig nor RuntimeInfo carries special tokens: the tokenizer does."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} | {f.name for f in dataclasses.fields(RuntimeInfo)}
    assert not {f for f in fields if "eos" in f or "bos" in f}
    assert not hasattr(PRESETS["gpt2-small-random"], "eos_token_id")
    tok = ByteTokenizer(PRESETS["gpt2-small-random"].vocab_size)
    assert tok.eos_token_ids == (BYTE_EOS_ID,) and tok.eos_token is None and tok.bos_token is None


def test_generation_stops_on_the_second_eos_id(ckpt: Path, free_run: list[int], tmp_path: Path) -> None:
    first = 0  # the tiny GPT-2's <|endoftext|>
    k = next(i for i in range(2, len(free_run)) if free_run[i] not in free_run[:i] + [first])
    second = free_run[k]
    _copy_checkpoint(ckpt, tmp_path)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [first, second]})
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", engine_config=ENGINE)
    assert llm.tokenizer.eos_token_ids == (first, second)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    (out,) = llm.generate(PROMPT, greedy)
    assert out.finish_reason == "stop" and out.token_ids == free_run[:k + 1]
    assert out.text == llm.tokenizer.decode(free_run[:k])  # the EOS token adds no text
    (held,) = llm.generate(PROMPT, dataclasses.replace(greedy, min_tokens=k + 2))
    assert len(held.token_ids) >= k + 2 and second not in held.token_ids[:k + 2]
    (ignored,) = llm.generate(PROMPT, dataclasses.replace(greedy, ignore_eos=True))
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


def test_offline_defaults_apply_when_generate_gets_no_params(ckpt: Path, free_run: list[int],
                                                             tmp_path: Path) -> None:
    _copy_checkpoint(ckpt, tmp_path)
    _write(tmp_path, "generation_config.json", {"temperature": 0.0, "top_k": 5})
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", engine_config=ENGINE)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 5, SamplingParams().max_tokens)
    # No params: the checkpoint's greedy default; explicit params are used as given (vLLM's rule).
    assert llm.generate(PROMPT)[0].token_ids == free_run[:defaults.max_tokens]
    sampled = llm.generate(PROMPT, SamplingParams(max_tokens=16, seed=1, ignore_eos=True))[0].token_ids
    assert sampled != free_run[:16]


def test_http_defaults_fill_only_the_fields_a_request_did_not_send() -> None:
    gen = GenerationConfig(sampling_defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                              "repetition_penalty": 1.05})
    client, engine, _ = stub_ingress(ByteTokenizer(), generation_config=gen)
    body = {"prompt": "Hi", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    p = engine.calls[-1][0].params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    sent = {"temperature": 1.0, "top_k": -1}  # the API's own defaults, sent explicitly, win
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 2, **sent}).status_code == 200
    p = engine.calls[-1][0].params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 0.9, -1, 1.05)
