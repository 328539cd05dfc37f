"""Start-up sizing (model/engine/memory.py, the builder's `memory_plan`): the KV cache's size from
kv_cache_memory_bytes, the CPU's default, or on CUDA gpu_memory_utilization after a profiling run;
a max_model_len that one sequence cannot fill refused at construction, naming the value that fits.
CUDA's arithmetic runs on the meta device with a stand-in for the GPU's memory
(tests/support/meta_device.py)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from pydantic import ValidationError

from model.config import EngineConfig
from model.engine.builder import build_engine, memory_plan
from model.engine.memory import CPU_KV_CACHE_BYTES, CPU_KVCACHE_ENV, GiB, cpu_kv_cache_bytes, module_bytes
from model.layers.kv_cache import KVCache
from model.llm import LLM
from model.loading.checkpoint import load_config
from model.models.reference_configs import REFERENCE_CONFIGS
from model.models.registry import build_model
from model.sampling.params import SamplingParams
from service.app import AppArgs
from tests.support.meta_device import META, FakeDeviceMemory, engine_on_meta, gpu_memory_on_meta
from tests.support.tiny_models import write_tiny_llama

# transformer-base: 6 layers, 8 heads of 64, float32 on the CPU; max_position 1024
BASE_BLOCK = KVCache.bytes_per_block(6, 16, 8, 64, torch.float32)

def test_a_max_model_len_the_cache_cannot_hold_is_refused_naming_the_value_that_fits() -> None:
    ten_blocks = 10 * BASE_BLOCK  # 160 tokens; transformer-base's max_model_len is 1024
    with pytest.raises(ValueError) as err:
        build_engine("transformer-base", EngineConfig(kv_cache_memory_bytes=ten_blocks), device="cpu")
    message = str(err.value)
    assert "max_model_len 1024 does not fit" in message and "max_model_len <= 160" in message
    for knob in ("gpu_memory_utilization", "kv_cache_memory_bytes", "kv_cache_dtype", "quantization"):
        assert knob in message
    # the same cache with max_model_len lowered to what fits starts, and serves a full-length sequence
    llm = LLM("transformer-base", device="cpu", engine_config=EngineConfig(kv_cache_memory_bytes=ten_blocks,
                                                                          max_model_len=160))
    assert llm.engine.runtime.num_kv_blocks == 10 and llm.engine.runtime.max_model_len == 160
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=60, ignore_eos=True, temperature=0))[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"


def test_a_forced_num_kv_blocks_is_an_override_that_warns_and_refuses_each_request_too_long(caplog) -> None:
    """num_kv_blocks is vLLM's num_gpu_blocks_override: the engine starts with the pool it is
    given, says max_model_len does not fit, and a request needing more blocks than the pool holds
    is refused on its own."""
    with caplog.at_level("WARNING", logger="model.engine.builder"):
        engine = build_engine("transformer-base", EngineConfig(num_kv_blocks=4), device="cpu")
    assert engine.runtime.num_kv_blocks == 4
    assert any("max_model_len 1024 does not fit" in r.getMessage() and "max_model_len <= 64" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="request needs 5 KV blocks but the pool has 4"):
        engine.add_request("long", [5] * 70, SamplingParams(max_tokens=4))


def test_bad_sizes_are_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="kv_cache_memory_bytes leaves 1000 bytes.*less than one block"):
        build_engine("transformer-base", EngineConfig(kv_cache_memory_bytes=1000), device="cpu")
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineConfig(gpu_memory_utilization=bad)
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            AppArgs(gpu_memory_utilization=bad)
    with pytest.raises(ValidationError, match="kv_cache_memory_bytes"):
        AppArgs(kv_cache_memory_bytes=0)


def test_kv_cache_bytes_is_a_deprecated_alias() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = EngineConfig(kv_cache_bytes=1 << 20)
    assert config.kv_cache_memory_bytes == 1 << 20
    assert any(issubclass(w.category, DeprecationWarning) and "kv_cache_memory_bytes" in str(w.message)
               for w in caught)
    assert EngineConfig(kv_cache_bytes=1 << 20, kv_cache_memory_bytes=1 << 20).kv_cache_memory_bytes == 1 << 20
    with pytest.raises(ValueError, match="set only kv_cache_memory_bytes"):
        EngineConfig(kv_cache_bytes=1 << 20, kv_cache_memory_bytes=2 << 20)


def test_the_cpu_default_is_4_gib_and_the_environment_variable_changes_it(monkeypatch) -> None:
    monkeypatch.delenv(CPU_KVCACHE_ENV, raising=False)
    assert cpu_kv_cache_bytes() == CPU_KV_CACHE_BYTES == 4 * GiB
    monkeypatch.setenv(CPU_KVCACHE_ENV, "0.0625")  # 64 MiB: 170 transformer-base blocks
    engine = build_engine("transformer-base", EngineConfig(max_model_len=256), device="cpu")
    assert engine.runtime.num_kv_blocks == (64 << 20) // BASE_BLOCK
    assert engine.runtime.kv_cache_bytes == engine.runtime.num_kv_blocks * BASE_BLOCK
    assert set(engine.runtime.startup_seconds) == {"load", "kv_cache"}  # no profiling run on the CPU
    monkeypatch.setenv(CPU_KVCACHE_ENV, "lots")
    with pytest.raises(ValueError, match=f"{CPU_KVCACHE_ENV} must be a number of GiB"):
        cpu_kv_cache_bytes()


def test_the_cache_never_exceeds_what_every_sequence_slot_needs() -> None:
    engine = build_engine("transformer-base", EngineConfig(kv_cache_memory_bytes=1 << 30, max_num_seqs=2,
                                                           max_model_len=100), device="cpu")
    assert engine.runtime.num_kv_blocks == 2 * 7  # 100 tokens: 7 blocks of 16, for each of 2 slots


@pytest.fixture
def llama_dir(tmp_path) -> str:
    return str(write_tiny_llama(tmp_path / "tiny", max_position_embeddings=2048))


def test_on_cuda_the_cache_gets_the_share_left_after_the_weights_and_the_profiled_peak(monkeypatch, llama_dir) -> None:
    """An engine on the meta device sized as on CUDA: utilization x total - weights - the profiling
    run's peak, in blocks; the profiling run ran (through the model on meta) and was timed."""
    fake = FakeDeviceMemory(total=64 << 20, activation_peak=3 << 20)
    with engine_on_meta(monkeypatch), gpu_memory_on_meta(monkeypatch, fake):
        engine = build_engine(llama_dir, EngineConfig(gpu_memory_utilization=0.5, max_num_seqs=64), device="cuda")
    runtime = engine.runtime
    cfg = engine.model_config
    per_block = KVCache.bytes_per_block(cfg.n_layers, 16, cfg.kv_heads, cfg.d_head, torch.float32)
    weights = module_bytes(engine.runner.model)
    assert fake.profiled == 1 and "profile" in runtime.startup_seconds
    assert runtime.weights_bytes == weights and runtime.activation_peak_bytes == 3 << 20
    assert runtime.num_kv_blocks == (int(0.5 * (64 << 20)) - weights - (3 << 20)) // per_block


def test_on_cuda_a_share_below_the_weights_or_a_busy_device_is_refused(monkeypatch, llama_dir) -> None:
    with engine_on_meta(monkeypatch), gpu_memory_on_meta(monkeypatch, FakeDeviceMemory(1 << 20, 1 << 20)):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 gives this engine 0.00 GiB"):
            build_engine(llama_dir, EngineConfig(), device="cuda")
    busy = FakeDeviceMemory(total=64 << 20, activation_peak=1 << 20, free=4 << 20)
    with engine_on_meta(monkeypatch), gpu_memory_on_meta(monkeypatch, busy):
        with pytest.raises(ValueError, match=r"only 0.00 GiB of the device is free.*lower gpu_memory_utilization"):
            build_engine(llama_dir, EngineConfig(), device="cuda")


def test_on_cuda_a_max_model_len_that_cannot_fit_is_refused(monkeypatch, llama_dir) -> None:
    with engine_on_meta(monkeypatch):
        probe = build_engine(llama_dir, EngineConfig(num_kv_blocks=128), device="cuda")  # 2048 tokens
    weights = probe.runtime.weights_bytes
    cfg = probe.model_config
    per_block = KVCache.bytes_per_block(cfg.n_layers, 16, cfg.kv_heads, cfg.d_head, torch.float32)
    peak = 1 << 20
    fake = FakeDeviceMemory(total=int((weights + peak + 100 * per_block) / 0.9) + 1, activation_peak=peak)
    with engine_on_meta(monkeypatch), gpu_memory_on_meta(monkeypatch, fake):
        with pytest.raises(ValueError, match=r"max_model_len 2048 does not fit.*100 blocks.*from "
                                             r"gpu_memory_utilization.*max_model_len <= 1600"):
            build_engine(llama_dir, EngineConfig(), device="cuda")
        assert build_engine(llama_dir, EngineConfig(max_model_len=1600), device="cuda").runtime.num_kv_blocks == 100


def test_llama_31_8b_bf16_at_0_9_of_80_gb_holds_a_131072_token_sequence(monkeypatch, tmp_path) -> None:
    """The arithmetic of the docs' memory page with Llama-3.1-8B's real config.json: weights from the
    model built on meta (8.03 B parameters in bfloat16), 128 KiB of K and V per token, a profiling
    run through the real shape (its peak a 2 GiB stand-in: meta allocates nothing), 80 GB."""
    (tmp_path / "config.json").write_text(json.dumps(REFERENCE_CONFIGS["meta-llama/Llama-3.1-8B"]))
    cfg = load_config(tmp_path)
    with torch.device("meta"):
        net = build_model(cfg).to(torch.bfloat16).eval()
    weights = module_bytes(net)
    params = sum(p.numel() for p in net.parameters())
    assert params == 8_030_261_248
    assert 2 * params <= weights < 2 * params + (1 << 30)  # and the rotary tables
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bfloat16
    per_block = KVCache.bytes_per_block(cfg.n_layers, 16, cfg.kv_heads, cfg.d_head, torch.bfloat16)
    assert per_block == 16 * per_token == 2 << 20
    total, peak = 80 * 10**9, 2 * GiB
    fake = FakeDeviceMemory(total=total, activation_peak=peak)
    ec = EngineConfig()  # gpu_memory_utilization 0.9, max_num_seqs 64, max_num_batched_tokens 2048
    with engine_on_meta(monkeypatch), gpu_memory_on_meta(monkeypatch, fake):
        plan = memory_plan(ec, cfg, net, 131072, torch.bfloat16, META, {})
    assert fake.profiled == 1
    assert plan.num_blocks == (int(0.9 * total) - weights - peak) // per_block
    assert plan.num_blocks * 16 >= 131072  # one full-length sequence fits, with room for
    assert plan.num_blocks // (131072 // 16) >= 3  # at least three of them at once
