"""The models x features table (docs/models-features.md) is read from the code: every architecture
of the registry has a row, and the rows agree with what the model pages state and the tests check
elsewhere (Mistral's window on every layer, Gemma's alternating ones, experts and vision towers
left in float, tensor parallelism for the dense families only)."""

from __future__ import annotations

from typing import Any

from tests.support.docs_generator import load_generate


generate = load_generate()


def features() -> dict[str, Any]:
    from model.models.registry import ARCHITECTURES

    return {name: generate.architecture_features(name, spec) for name, spec in ARCHITECTURES.items()}


def test_every_architecture_has_a_row_that_agrees_with_the_model_pages() -> None:
    rows = features()
    table = generate.models_features_table()
    assert all(f"| `{name}` |" in table for name in rows)
    assert rows["MistralForCausalLM"].window == "every layer" and rows["LlamaForCausalLM"].window == ""
    assert rows["Gemma2ForCausalLM"].window == "some layers" and rows["GptOssForCausalLM"].window == "some layers"
    assert {n for n, r in rows.items() if r.moe} == {"MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                                    "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
    assert all("experts in float" in r.quantized for r in rows.values() if r.moe)
    assert {n for n, r in rows.items() if r.vision} == {"Qwen2VLForConditionalGeneration",
                                                       "Qwen2_5_VLForConditionalGeneration",
                                                       "LlavaForConditionalGeneration"}
    assert all("vision tower in float" in r.quantized for r in rows.values() if r.vision)
    assert {r.arch for r in rows.values() if r.tensor_parallel} == {"transformer", "gpt2", "llama"}
    assert all(r.quantized and r.lora for r in rows.values())
    assert "`q_proj`" in rows["LlamaForCausalLM"].lora and "`qkv_proj`" in rows["Phi3ForCausalLM"].lora
