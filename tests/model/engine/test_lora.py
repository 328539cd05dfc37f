"""LoRA adapters made with `peft` on tiny Llama, Qwen2 and GPT-2 checkpoints, served over the base
model: greedy output equal to peft's merged model (merge_and_unload) and logits within 1e-4 in fp32;
a batch mixing three adapters and the base model, each row equal to its own run alone; the prefix
cache never crossing adapters; LRU eviction under max_loras with a request in flight; dynamic
loading by `base:adapter`; the load errors; /v1/models (dynamic adapters once loaded) and a completion
by adapter name over HTTP, counted per adapter.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.engine import Engine
from model.layers.lora import LoraBatch
from model.loading.lora import LoraError, LoraNotFoundError, load_adapter
from model.sampling.params import SamplingParams
from tests.support.tiny_models import build_tiny_gpt2, build_tiny_llama, build_tokenizer, full_logits, hf_greedy, torch_threads
from tests.support.requirements import need_module

peft = need_module("peft")

LOGITS_ATOL = 1e-4  # fp32
TOKENS = 12
PROMPT = [7, 19, 3, 250, 41, 88, 120, 5, 66, 12, 90, 31, 200, 17, 9, 144, 60, 2, 77, 130]  # 20: 2 full blocks of 8
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "qwen2": ["q_proj", "v_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"]}  # GPT-2's fused qkv (Conv1D), attn/MLP out (c_proj), MLP in
_IDS = itertools.count()
# name -> (r, lora_alpha, use_rslora, seed) of the Llama adapters
LLAMA_ADAPTERS = {"a": (4, 8, False, 1), "b": (8, 4, True, 2), "c": (2, 4, False, 3)}


def _base(arch: str):
    return build_tiny_gpt2() if arch == "gpt2" else build_tiny_llama(arch)


def _save_base(arch: str, directory: Path) -> Path:
    _base(arch).save_pretrained(directory)
    build_tokenizer(301).save(str(directory / "tokenizer.json"))
    return directory


def _make_adapter(arch: str, directory: Path, r: int, alpha: int, rslora: bool, seed: int,
                  targets: list[str] | None = None, **extra) -> torch.nn.Module:
    """An adapter with random non-zero A and B (init_lora_weights=False) saved to `directory`;
    returns peft's merged model (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets or TARGETS[arch],
                        init_lora_weights=False, **extra)
    model = get_peft_model(_base(arch), config)
    model.save_pretrained(directory)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Base checkpoints of the three families, one adapter each (three for Llama) with its merged model."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    with torch_threads(1):
        for arch in ("llama", "qwen2", "gpt2"):
            base = _save_base(arch, root / arch)
            adapters = LLAMA_ADAPTERS if arch == "llama" else {"a": (4, 8, arch == "qwen2", 5)}
            merged = {}
            for name, (r, alpha, rslora, seed) in adapters.items():
                merged[name] = _make_adapter(arch, root / f"{arch}-adapters" / name, r, alpha, rslora, seed)
            out[arch] = (base, root / f"{arch}-adapters", merged)
    return out


def _engine(base: Path, **lora) -> Engine:
    config = EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=8, **lora)
    return build_engine(str(base), config, device="cpu", dtype="float32")


def _run(engine: Engine, requests: list[tuple[list[int], str | None]], max_tokens: int = TOKENS) -> list[dict]:
    """All `requests` (prompt, adapter) added before the first step; each one's tokens and cached count."""
    p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"r{next(_IDS)}" for _ in requests]
    for rid, (prompt, lora) in zip(ids, requests):
        engine.add_request(rid, prompt, p, lora=lora)
    got = {rid: {"tokens": [], "cached": 0} for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id]["tokens"] += out.new_token_ids
            got[out.request_id]["cached"] = max(got[out.request_id]["cached"], out.num_cached_tokens)
    return [got[rid] for rid in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_adapter_equals_peft_merged_model(ckpts, arch):
    base, adapters, merged = ckpts[arch]
    with torch_threads(1):
        engine = _engine(base, lora_modules={name: str(adapters / name) for name in merged})
        for name, ref_model in merged.items():
            served = _run(engine, [(PROMPT, name)])[0]["tokens"]
            assert served == hf_greedy(ref_model, PROMPT, TOKENS), (arch, name)
            slot = engine.lora.acquire(name)
            with engine.lora.state.use(LoraBatch.of([slot] * len(PROMPT), engine.device)):
                ours = full_logits(engine.runner.model, PROMPT)
            engine.lora.release(name)
            with torch.no_grad():
                ref = ref_model(torch.tensor([PROMPT])).logits[0]
            torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"{arch} {name}: {m}")
        base_out = _run(engine, [(PROMPT, None)])[0]["tokens"]
        assert base_out == hf_greedy(_base(arch), PROMPT, TOKENS)
        assert base_out != served  # the delta matters


def test_mixed_batch_rows_equal_their_runs_alone(ckpts):
    base, adapters, _ = ckpts["llama"]
    prompts = [PROMPT, PROMPT[3:17], PROMPT[::-1], PROMPT[5:]]
    loras = ["a", "b", None, "c"]
    with torch_threads(1):
        engine = _engine(base, lora_modules={n: str(adapters / n) for n in LLAMA_ADAPTERS},
                         enable_prefix_caching=False)
        alone = [_run(engine, [(p, lora)])[0]["tokens"] for p, lora in zip(prompts, loras)]
        mixed = _run(engine, list(zip(prompts, loras)))
    assert [m["tokens"] for m in mixed] == alone
    same_prompt = _run(engine, [(PROMPT, lora) for lora in ("a", "b", "c", None)])
    assert len({tuple(o["tokens"]) for o in same_prompt}) == 4  # each row got its own adapter


def test_prefix_cache_never_crosses_adapters(ckpts):
    base, adapters, merged = ckpts["llama"]
    with torch_threads(1):
        engine = _engine(base, lora_modules={n: str(adapters / n) for n in ("a", "b")})
        first = _run(engine, [(PROMPT, "a")])[0]
        second = _run(engine, [(PROMPT, "b")])[0]
        assert second["cached"] == 0
        assert second["tokens"] == hf_greedy(merged["b"], PROMPT, TOKENS)
        base_run = _run(engine, [(PROMPT, None)])[0]
        assert base_run["cached"] == 0
        again = _run(engine, [(PROMPT, "a")])[0]
    assert again["cached"] == 16  # the cache itself works: a's two full blocks
    assert again["tokens"] == first["tokens"]


def test_lru_eviction_keeps_adapters_in_flight(ckpts):
    base, adapters, merged = ckpts["llama"]
    p = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    got: dict[str, list[int]] = {}

    def step(engine: Engine) -> None:
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)

    with torch_threads(1):
        engine = _engine(base, lora_modules={n: str(adapters / n) for n in LLAMA_ADAPTERS}, max_loras=2)
        engine.add_request("long-a", PROMPT, p, lora="a")  # a: in flight all along
        step(engine)
        engine.add_request("short-b", PROMPT[2:], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                           lora="b")
        while "short-b" not in got or len(got["short-b"]) < 2:
            step(engine)
        assert set(engine.lora.slot_of) == {"a", "b"}  # b: finished, idle, the most recently used
        engine.add_request("c", PROMPT[4:], p, lora="c")  # both slots taken: b (idle) goes, a stays
        assert set(engine.lora.slot_of) == {"a", "c"} and engine.lora.num_evictions == 1
        engine.add_request("b-waits", PROMPT, p, lora="b")  # a and c in use: b waits for a slot
        waited = 0
        while engine.has_unfinished():
            waited += "b-waits" not in got
            step(engine)
    assert waited >= TOKENS - 3  # b started only once a had finished
    assert got["long-a"] == hf_greedy(merged["a"], PROMPT, TOKENS)
    assert got["c"] == hf_greedy(merged["c"], PROMPT[4:], TOKENS)
    assert got["b-waits"] == hf_greedy(merged["b"], PROMPT, TOKENS)
    stats = engine.stats()
    assert (stats.lora_adapter_loads, stats.lora_adapter_evictions, stats.lora_adapters_loaded) == (4, 2, 2)


def test_dynamic_loading_by_base_colon_adapter(ckpts):
    base, adapters, merged = ckpts["llama"]
    with torch_threads(1):
        engine = _engine(base, lora_dynamic_path=str(adapters))
        out = _run(engine, [(PROMPT, f"{base}:c")])[0]["tokens"]
        assert out == hf_greedy(merged["c"], PROMPT, TOKENS)
        assert f"{base}:c" in engine.lora.names()
        with pytest.raises(LoraNotFoundError, match="nope"):
            engine.add_request("x", PROMPT, SamplingParams(max_tokens=2), lora=f"{base}:nope")
        with pytest.raises(LoraNotFoundError, match="unknown LoRA adapter 'other:c'"):
            engine.add_request("y", PROMPT, SamplingParams(max_tokens=2), lora="other:c")
        assert not engine.has_unfinished()


def test_load_errors_name_what_does_not_fit(ckpts, tmp_path):
    base, adapters, _ = ckpts["llama"]
    engine = _engine(base, lora_modules={"a": str(adapters / "a")}, max_lora_rank=4)
    mgr = engine.lora

    def load(path: Path, max_rank: int = 4):
        return load_adapter("x", str(path), mgr.modules, mgr.layers, max_rank, torch.float32)

    with pytest.raises(LoraError, match="rank 8, above max_lora_rank=4"):
        load(adapters / "b")
    _make_adapter("llama", tmp_path / "save", 4, 8, False, 0, modules_to_save=["lm_head"])
    with pytest.raises(LoraError, match="modules_to_save="):
        load(tmp_path / "save")
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.loads((adapters / "a" / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora=True is not supported"):
        load(dora)
    _make_adapter("gpt2", tmp_path / "gpt2", 4, 8, False, 0)
    with pytest.raises(LoraError, match="'transformer.h.0.attn.c_attn', which is not a linear layer"):
        load(tmp_path / "gpt2")
    from peft import LoraConfig, get_peft_model

    wide = build_tiny_llama(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    get_peft_model(wide, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
        tmp_path / "wide")
    with pytest.raises(LoraError, match=r"lora_A \(4, 32\).*needs \(4, 64\)"):
        load(tmp_path / "wide")
    with pytest.raises(LoraError, match="has no adapter_config.json"):
        load(tmp_path)
    with pytest.raises(ValueError, match="serves no adapters"):
        _engine(base).add_request("z", PROMPT, SamplingParams(max_tokens=1), lora="a")


def test_http_models_lists_adapters_and_completes_by_name(ckpts):
    import asyncio

    import httpx

    from tests.support.in_process import edge_app

    base, adapters, merged = ckpts["llama"]

    async def main():
        engine = _engine(base, lora_modules={"a": str(adapters / "a")}, lora_dynamic_path=str(adapters))
        async with edge_app(engine, "tiny") as app:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                models = (await client.get("/v1/models")).json()["data"]
                body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                by_name = (await client.post("/v1/completions", json={**body, "model": "a"})).json()
                dynamic = (await client.post("/v1/completions", json={**body, "model": "tiny:c"})).json()
                missing = await client.post("/v1/completions", json={**body, "model": "tiny:nope"})
                unknown = await client.post("/v1/completions", json={**body, "model": "zzz"})
                after = (await client.get("/v1/models")).json()["data"]  # the dynamic adapter, once loaded
                counted = dict(app.state.host.metrics.lora_requests)
        return models, by_name, dynamic, missing, unknown, after, counted, engine.tokenizer

    with torch_threads(1):
        models, by_name, dynamic, missing, unknown, after, counted, tok = asyncio.run(main())
    assert [(m["id"], m.get("parent")) for m in models] == [("tiny", None), ("a", "tiny")]
    assert [(m["id"], m.get("parent")) for m in after] == [("tiny", None), ("a", "tiny"), ("tiny:c", "tiny")]
    assert counted == {"a": 1, "tiny:c": 1}  # requests per adapter (the 404s never reached the engine)
    assert by_name["choices"][0]["text"] == tok.decode(hf_greedy(merged["a"], PROMPT, TOKENS))
    assert dynamic["choices"][0]["text"] == tok.decode(hf_greedy(merged["c"], PROMPT, TOKENS))
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
