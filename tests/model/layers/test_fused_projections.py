"""q/k/v and gate/up fused into one product each after the weights load (model/layers/linear/fuse.py):
the fused layer computes the parts side by side in every weight format, parts that cannot share a
product stay apart, and an engine with fused projections generates the unfused model's tokens
(float32, int8, int4; GQA, q/k/v biases, q/k norms; a LoRA adapter on the parts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from model.config import EngineConfig
from model.engine import builder
from model.engine.builder import build_engine
from model.layers.linear.dense import Linear
from model.layers.linear.fuse import fuse_linears, fuse_projections
from model.layers.linear.quantized import QuantizedLinear, quantize_int4
from model.sampling.params import SamplingParams
from tests.support.requirements import need_module
from tests.support.tiny_models import torch_threads, write_tiny_llama

PROMPTS = [[7, 19, 3, 250, 41, 88, 120, 5, 66, 12], [200, 17, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def dense_parts(sizes: tuple[int, ...], bias: bool, seed: int = 0) -> list[Linear]:
    torch.manual_seed(seed)
    parts = [Linear(64, n, bias=bias) for n in sizes]
    for p in parts:
        p.requires_grad_(False)
    return parts


def quantized_parts(sizes: tuple[int, ...], bits: int, group: int, offsets: bool,
                    perm: torch.Tensor | None = None) -> list[QuantizedLinear]:
    parts = []
    for i, n in enumerate(sizes):
        layer = QuantizedLinear(64, n, bits, group, bias=True, has_offsets=offsets, act_order=perm is not None)
        torch.manual_seed(i)
        w = torch.randn(n, 64)
        if perm is None:
            layer.quantize_from(w)
        else:  # GPTQ's act-order: codes in group order, the input permuted by `perm`
            layer.set_codes(*quantize_int4(w[:, perm], group), perm=perm)
        with torch.no_grad():
            layer.bias.copy_(torch.randn(n))
        parts.append(layer)
    return parts


@pytest.mark.parametrize("rows", [1, 5, 40])  # the dense kernel, the few-row and the many-row products
@pytest.mark.parametrize("kind", ["dense", "dense-bias", "int8", "int4", "int4-act-order"])
def test_a_fused_layer_computes_its_parts_side_by_side(kind: str, rows: int) -> None:
    sizes = (64, 32, 32)  # q with 4 heads, k and v with 2 (grouped-query attention)
    if kind.startswith("dense"):
        parts = dense_parts(sizes, bias=kind == "dense-bias")
    else:
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)) if kind.endswith("act-order") else None
        parts = quantized_parts(sizes, 8 if kind == "int8" else 4, 64 if kind == "int8" else 32,
                                offsets=kind != "int8", perm=perm)
    fused = fuse_linears(parts, ("q_proj", "k_proj", "v_proj"))
    assert fused is not None and type(fused) is type(parts[0])
    assert fused.fused_from == (("q_proj", 64), ("k_proj", 32), ("v_proj", 32))
    assert (fused.in_features, fused.out_features) == (64, 128)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        want = torch.cat([p(x) for p in parts], dim=-1)
        got = fused(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_parts_that_cannot_share_one_product_stay_apart() -> None:
    names = ("a", "b")
    dense, quantized = dense_parts((32, 32), bias=False), quantized_parts((32, 32), 8, 64, offsets=False)
    assert fuse_linears([dense[0], quantized[1]], names) is None  # float and quantized
    assert fuse_linears([dense[0], *dense_parts((32,), bias=True)], names) is None  # a bias on one only
    assert fuse_linears([dense[0], dense[1].to(torch.bfloat16)], names) is None  # two dtypes
    assert fuse_linears([quantized[0], *quantized_parts((32,), 4, 32, offsets=True)], names) is None  # formats
    one, other = (torch.randperm(64, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    act_order = quantized_parts((32,), 4, 32, True, one) + quantized_parts((32,), 4, 32, True, other)
    assert fuse_linears(act_order, names) is None  # GPTQ act-order with two input permutations
    assert fuse_linears([nn.Conv1d(4, 4, 1), nn.Conv1d(4, 4, 1)], names) is None


def test_fusing_a_llama_model_leaves_one_product_per_group(tmp_path: Path) -> None:
    from model.loading.checkpoint import load_model

    _, net = load_model(write_tiny_llama(tmp_path / "llama"))
    assert fuse_projections(net) == 4  # two layers: attention and MLP each
    assert fuse_projections(net) == 0  # once
    attn, mlp = net.layers[0].self_attn, net.layers[0].mlp
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.out_features == (4 + 2 + 2) * 16
    assert not hasattr(mlp, "gate_proj") and mlp.gate_up_proj.out_features == 2 * 96


def _engine_tokens(directory: Path, monkeypatch: pytest.MonkeyPatch, fused: bool, **engine) -> tuple[list, int]:
    """Greedy tokens of PROMPTS through one batch, and how many modules the engine fused."""
    count = {"fused": 0}

    def fuse(net: nn.Module) -> int:
        count["fused"] = fuse_projections(net) if fused else 0
        return count["fused"]

    monkeypatch.setattr(builder, "fuse_projections", fuse)
    with torch_threads(1):
        llm = build_engine(str(directory), EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=4, **engine),
                           device="cpu", dtype="float32")
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            llm.add_request(f"r{i}", prompt, params, lora=engine.get("lora_modules") and "a")
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        while llm.has_unfinished():
            for out in llm.step():
                got[out.request_id] += out.new_token_ids
    return [got[f"r{i}"] for i in range(len(PROMPTS))], count["fused"]


CASES = {"llama": ("llama", {}), "qwen2-biases": ("qwen2", {}), "qwen3-qk-norm": ("qwen3", {}),
         "llama-int8": ("llama", {"quantization": "int8"}), "llama-int4": ("llama", {"quantization": "int4",
                                                                                       "quantization_group_size": 32})}


@pytest.mark.parametrize("case", CASES)
def test_an_engine_with_fused_projections_generates_the_unfused_tokens(case: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    arch, engine = CASES[case]
    directory = write_tiny_llama(tmp_path / arch, arch=arch)
    unfused, none = _engine_tokens(directory, monkeypatch, False, **engine)
    fused, count = _engine_tokens(directory, monkeypatch, True, **engine)
    assert none == 0 and count == 4
    assert fused == unfused


def test_a_lora_adapter_of_the_parts_applies_to_the_fused_product(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    need_module("peft")
    from peft import LoraConfig, get_peft_model

    from tests.support.tiny_models import build_tiny_llama

    directory = write_tiny_llama(tmp_path / "llama")
    torch.manual_seed(4)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    get_peft_model(build_tiny_llama(), config).save_pretrained(tmp_path / "a")
    lora = {"lora_modules": {"a": str(tmp_path / "a")}}
    base, _ = _engine_tokens(directory, monkeypatch, True)
    unfused, _ = _engine_tokens(directory, monkeypatch, False, **lora)
    fused, count = _engine_tokens(directory, monkeypatch, True, **lora)
    assert count == 4 and fused == unfused
    assert fused != base  # the adapter changed the tokens
