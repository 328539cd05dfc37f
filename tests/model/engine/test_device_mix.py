"""Device mixes caught on the CPU: the engine's steps on the `meta` device (tests/support/meta_device.py),
where an op that mixes in a CPU tensor raises as it would on CUDA. Each case runs a batch through
`Engine.step()` until every request finishes: sampling with temperature, top-k/p, penalties,
logit bias, logprobs and min_tokens; prompt logprobs; prefix-cache tails; the gather and flex
backends; additive attention; a GQA + RoPE checkpoint in bfloat16; quantized layers; speculative
decoding (ngram and a draft model); LoRA adapters; structured outputs. The sampler's device mix
of issue 43 (temperatures, top-k/p and penalty counts made on the CPU) failed the sampled cases
here before it was fixed; `test_the_harness_catches_a_device_mix` keeps the harness honest."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.meta_device import engine_on_meta
from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.sampling.params import SamplingParams
from model.sampling.sampler import SamplingRow, sample
from tests.support.tiny_models import build_tiny_llama, build_tokenizer, write_tiny_llama
from tests.support.requirements import need_module

PROMPT = [5, 17, 42, 99, 7, 23, 64, 81, 12, 33, 56, 70]  # 12 tokens: 3 blocks of 4 (two full)
SAMPLED = [
    SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1),
    SamplingParams(max_tokens=3, temperature=0.8, top_k=5, top_p=0.9, min_tokens=2),
    SamplingParams(max_tokens=3, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.2, logit_bias={3: 2.0, 9: -100.0}, logprobs=0),
    SamplingParams(max_tokens=3, temperature=0.7, top_p=0.5, ignore_eos=True),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("meta-llama")))  # GQA: 4 query heads, 2 KV heads


def _run(engine: Engine, params: list[SamplingParams], lora: str | None = None,
         prompt: list[int] = PROMPT) -> dict[str, list[int]]:
    """Each request's tokens: the first alone, then the rest together, every other one with a
    prompt that shares its first 8 tokens (a prefix-cache hit whose tail is a short prefill chunk
    after a cached past)."""
    got: dict[str, list[int]] = {}

    def drain() -> None:
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request("first", prompt, params[0], lora=lora)
    drain()
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt[:8] + [200 + i, 201, 202] if i % 2 else prompt, p, lora=lora)
    drain()
    return got


def _engine(model: str, **config) -> Engine:
    config = {"num_kv_blocks": 48, "block_size": 4, "max_num_seqs": 8, **config}
    dtype = config.pop("dtype", "auto")
    return build_engine(model, EngineConfig(**config), device="cuda", dtype=dtype)


def _check(got: dict[str, list[int]], params: list[SamplingParams], mode, tokens: int = 3) -> None:
    assert set(got) == {"first", *(f"r{i}" for i in range(len(params)))}
    assert all(len(t) == tokens for t in got.values()), got  # every request ran to max_tokens
    assert mode.reads > 0  # the steps did read the device (the sampled tokens)


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_sampling_and_prefix_tails_on_the_paper_model(monkeypatch, backend) -> None:
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine("transformer-base", attention_backend=backend)
        assert engine.device.type == "meta" and engine.runner.backend == backend
        got = _run(engine, SAMPLED)
    _check(got, SAMPLED, mode)


def test_additive_attention(monkeypatch) -> None:
    with engine_on_meta(monkeypatch) as mode:
        got = _run(_engine("transformer-base-additive"), SAMPLED)
    _check(got, SAMPLED, mode)


@pytest.mark.parametrize("backend", ["gather", "flex"])
def test_gqa_rope_checkpoint_in_bfloat16(monkeypatch, llama_dir, backend) -> None:
    with engine_on_meta(monkeypatch) as mode:
        got = _run(_engine(llama_dir, attention_backend=backend, dtype="bfloat16"), SAMPLED)
    _check(got, SAMPLED, mode)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layers_and_head(monkeypatch, llama_dir, quantization) -> None:
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine(llama_dir, quantization=quantization, quantization_group_size=32, quantize_lm_head=True)
        got = _run(engine, SAMPLED)
    _check(got, SAMPLED, mode)


# Every token sampled on meta is 1: a prompt of 1s gives the ngram proposer a match at each step.
SPEC_PROMPT = [1] * 6 + PROMPT[:6]
SPEC_PARAMS = [dataclasses.replace(p, max_tokens=6, ignore_eos=True) for p in SAMPLED]


def test_ngram_speculative_decoding(monkeypatch, llama_dir) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine(llama_dir, speculative_config=spec)
        got = _run(engine, SPEC_PARAMS, prompt=SPEC_PROMPT)
        assert engine.stats().spec_decode_num_draft_tokens > 0
    _check(got, SPEC_PARAMS, mode, tokens=6)


def test_draft_model_speculative_decoding(monkeypatch, llama_dir, tmp_path) -> None:
    draft = write_tiny_llama(tmp_path / "draft", seed=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine(llama_dir, speculative_config=spec)
        got = _run(engine, SPEC_PARAMS, prompt=SPEC_PROMPT)
        assert engine.stats().spec_decode_num_draft_tokens > 0
    _check(got, SPEC_PARAMS, mode, tokens=6)


def test_lora_adapter(monkeypatch, tmp_path) -> None:
    peft = need_module("peft")
    base = tmp_path / "base"
    build_tiny_llama().save_pretrained(base)
    build_tokenizer(301).save(str(base / "tokenizer.json"))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    peft.get_peft_model(build_tiny_llama(), config).save_pretrained(tmp_path / "adapter")
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine(str(base), lora_modules={"a": str(tmp_path / "adapter")})
        got = _run(engine, SAMPLED, lora="a")
    _check(got, SAMPLED, mode)


def test_structured_outputs(monkeypatch, llama_dir) -> None:
    # Token 1 is "!" in the tiny tokenizer: the grammar accepts the tokens meta samples.
    params = [SamplingParams(max_tokens=3, temperature=t, choice=["!!!!", "!!!?"]) for t in (0.0, 0.9)]
    with engine_on_meta(monkeypatch) as mode:
        got = _run(_engine(llama_dir), params)
    _check(got, params, mode)


def test_the_harness_catches_a_device_mix(monkeypatch) -> None:
    """A logits processor that adds a CPU tensor to the row: a device mix on CUDA, and here."""
    def cpu_bias(row: torch.Tensor) -> None:
        row += torch.ones(row.shape[0])

    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [], None, [], [cpu_bias])]
    with engine_on_meta(monkeypatch), pytest.raises(RuntimeError, match="expected device meta"):
        sample(torch.zeros(1, 16, device="meta"), rows)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_vision_language_model(monkeypatch, tmp_path, version) -> None:
    """Images through the encoder, its cache, the merged embeddings and M-RoPE positions, in a
    batch with a text request, and an attention map's recompute over the image."""
    from model.inspect.attention_spec import AttentionSpec
    from tests.support.vision_models import QWEN2_VL_IDS, random_image, save_tiny_qwen2_vl

    directory = str(save_tiny_qwen2_vl(tmp_path / "vl", version=version))
    image = [QWEN2_VL_IDS["vision_start"], QWEN2_VL_IDS["image_pad"], QWEN2_VL_IDS["vision_end"]]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with engine_on_meta(monkeypatch) as mode:
        engine = _engine(directory, max_num_batched_tokens=16)  # chunks cut through the images
        for i in range(3):
            ids, mm = engine.process_images([7, 8] + image + [9, 10], [random_image(i, 112, 84)])
            engine.add_request(f"img{i}", ids, params, mm=mm)
        engine.add_request("text", PROMPT, params)
        ids, mm = engine.process_images(image + [11], [random_image(5, 56, 56)])
        engine.add_request("maps", ids, SamplingParams(max_tokens=1, attention=AttentionSpec()), mm=mm)
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.runner.encoder_cache.misses == 4
    assert {k: len(v) for k, v in got.items()} == {"img0": 3, "img1": 3, "img2": 3, "text": 3, "maps": 1}
    assert mode.reads > 0
