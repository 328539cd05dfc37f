"""Mixture-of-experts checkpoints saved by HF transformers give HF's logits and greedy
continuations: alone, inside a batch of 16 other requests, under forced preemption and from
the prefix cache.

Tiny random Mixtral (per-expert `w1/w3/w2`), Qwen2-MoE (shared expert, `decoder_sparse_step`,
saved in bf16 and sharded), Qwen3-MoE (`mlp_only_layers`, `norm_topk_prob`, q/k norms) and
gpt-oss (attention sinks, alternating sliding/full layers with a window shorter than the
prompt, YaRN, biased experts and router, its clamped SwiGLU). Below them: the MoE block
against a per-token loop, and the MXFP4 dequantization against transformers' own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.config import MoEConfig
from model.layers.moe import Experts, route
from model.loading.checkpoint import load_model
from tests.support.tiny_models import engine_greedy_runs, full_logits, hf_greedy, write_tiny_llama
from tests.support.tiny_models import one_thread  # noqa: F401  (autouse: this module runs on one torch thread)
from tests.support.requirements import need_module

transformers = need_module("transformers")

LOGITS_ATOL = 1e-4  # fp32
GREEDY_TOKENS = 32
PROMPT_LEN = 20  # two full blocks of 8: the prefix cache has something to hit
# Alternating sliding (8 positions, shorter than the 20-token prompt) and full layers, YaRN.
GPT_OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "head_dim": 16,
           "sliding_window": 8, "rope_parameters": {
               "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
# id -> (arch, save dtype, sharded, config overrides)
CASES = {
    "mixtral-8experts-top2": ("mixtral", None, False, {
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48}),
    "qwen2moe-shared-expert-sparse-step2-bf16-sharded": ("qwen2_moe", torch.bfloat16, True, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "norm_topk_prob": False}),
    "qwen3moe-mlp-only-layers-norm-topk": ("qwen3_moe", None, False, {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "mlp_only_layers": [1], "norm_topk_prob": True, "head_dim": 32}),
    "gptoss-sinks-window8-yarn": ("gpt_oss", None, False, GPT_OSS),
}
HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
DENSE_LAYERS = {"mixtral": (), "qwen2_moe": (0,), "qwen3_moe": (1,), "gpt_oss": ()}



@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory) -> tuple[str, Path, "transformers.PreTrainedModel", list[int], list[int]]:
    """The arch, a saved checkpoint, HF's model loaded back from it in fp32, a prompt and HF's
    greedy continuation of it."""
    arch, dtype, sharded, overrides = CASES[request.param]
    directory = write_tiny_llama(tmp_path_factory.mktemp(arch), arch, seed=len(request.param), dtype=dtype,
                                 max_shard_size="60KB" if sharded else None, with_tokenizer=False, **overrides)
    if sharded:
        assert len(list(directory.glob("model-*.safetensors"))) > 1
    hf = getattr(transformers, HF_CLASSES[arch]).from_pretrained(directory, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    prompt = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = hf_greedy(hf, prompt, GREEDY_TOKENS)
    return arch, directory, hf, prompt, expected


def test_config_is_read_from_config_json(case) -> None:
    arch, directory, hf, _, _ = case
    cfg, model = load_model(directory)
    c = hf.config
    experts = c.num_local_experts if hasattr(c, "num_local_experts") else c.num_experts
    assert (cfg.arch, cfg.n_layers, cfg.moe.num_experts, cfg.moe.top_k) == (
        "gpt_oss" if arch == "gpt_oss" else "moe", c.num_hidden_layers, experts, c.num_experts_per_tok)
    assert cfg.moe.dense_layers == DENSE_LAYERS[arch]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_logits_match_hf(case) -> None:
    _, directory, hf, _, _ = case
    _, model = load_model(directory)
    tokens = torch.randint(0, hf.config.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]  # (T, vocab)
    torch.testing.assert_close(full_logits(model, tokens, block_size=8), expected, atol=LOGITS_ATOL, rtol=0)


def test_greedy_continuation_matches_hf_alone_batched_preempted_and_from_the_prefix_cache(case) -> None:
    """Alone; again with the prompt's full blocks from the prefix cache; inside 16 other requests
    (prompts chunked over steps of 48 tokens); among 8 others in a pool that forces preemption."""
    _, directory, hf, prompt, expected = case
    runs = engine_greedy_runs(directory, prompt, GREEDY_TOKENS, hf.config.vocab_size)
    assert runs == dict.fromkeys(runs, expected)


def test_fused_expert_tensors_load_as_the_per_expert_ones(tmp_path: Path) -> None:
    """transformers' in-memory layout (`mlp.experts.gate_up_proj` (E, 2F, D), `down_proj`), saved
    as it is, loads to the same model as save_pretrained's per-expert tensors."""
    arch, _, _, overrides = CASES["mixtral-8experts-top2"]
    per_expert = write_tiny_llama(tmp_path / "per_expert", arch, with_tokenizer=False, **overrides)
    hf = transformers.MixtralForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    tokens = torch.arange(30) % hf.config.vocab_size
    got = full_logits(load_model(fused)[1], tokens, block_size=8)
    assert torch.equal(got, full_logits(load_model(per_expert)[1], tokens, block_size=8))


# ---- the MoE block against a per-token loop ------------------------------------------

MOE_VARIANTS = {
    "mixtral": MoEConfig(num_experts=6, top_k=2, d_expert=12, fp32_weights=True),
    "qwen-no-renorm": MoEConfig(num_experts=6, top_k=3, d_expert=12, norm_topk_prob=False),
    "gpt-oss": MoEConfig(num_experts=6, top_k=4, d_expert=12, routing="topk_softmax", router_bias=True,
                         expert_bias=True, activation="gpt_oss", swiglu_limit=0.5),
}


def _naive(x: torch.Tensor, logits: torch.Tensor, experts: Experts, moe: MoEConfig) -> torch.Tensor:
    """Each token, each of its top-k experts, written out from the definitions."""
    out = torch.zeros_like(x)
    f = moe.d_expert
    for t in range(x.shape[0]):
        if moe.routing == "topk_softmax":
            top, ids = logits[t].topk(moe.top_k)
            weights = top.softmax(-1)
        else:
            probs = logits[t].softmax(-1)
            weights, ids = probs.topk(moe.top_k)
            weights = weights / weights.sum() if moe.norm_topk_prob else weights
        for w, e in zip(weights, ids.tolist()):
            h = experts.gate_up_proj[e] @ x[t] + (experts.gate_up_proj_bias[e] if moe.expert_bias else 0)
            gate, up = h[:f], h[f:]
            if moe.activation == "silu":
                act = gate * torch.sigmoid(gate) * up
            else:
                gate, up = gate.clamp(max=moe.swiglu_limit), up.clamp(-moe.swiglu_limit, moe.swiglu_limit)
                act = (up + 1) * gate * torch.sigmoid(moe.swiglu_alpha * gate)
            y = experts.down_proj[e] @ act + (experts.down_proj_bias[e] if moe.expert_bias else 0)
            out[t] += w * y
    return out


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
@torch.no_grad()
def test_moe_block_equals_a_per_token_loop(variant: str) -> None:
    moe = MOE_VARIANTS[variant]
    torch.manual_seed(0)
    experts = Experts(16, moe)
    x = torch.randn(37, 16)
    logits = torch.randn(37, moe.num_experts)
    weights, ids = route(logits, moe)
    assert ids.shape == (37, moe.top_k) and len(set(ids[0].tolist())) == moe.top_k
    if moe.norm_topk_prob or moe.routing == "topk_softmax":
        torch.testing.assert_close(weights.sum(-1), torch.ones(37))
    else:
        assert (weights.sum(-1) < 1).all()
    torch.testing.assert_close(experts(x, weights, ids), _naive(x, logits, experts, moe), atol=1e-5, rtol=1e-5)


# ---- MXFP4 ---------------------------------------------------------------------------


def test_mxfp4_dequantization_equals_transformers() -> None:
    """A packed tensor written from the documented layout (blocks (E, R, G, 16) uint8 with two
    FP4 codes per byte, scales (E, R, G) uint8 exponents biased by 127) dequantizes to what
    transformers' gpt-oss loader computes (which then transposes to (E, C, R))."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from model.models.expert_weights import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 137, (3, 10, 4), dtype=torch.uint8, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)  # (E, R, 128)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (E, 128, R)
        assert ours.dtype == dtype and ours.shape == (3, 10, 128)
        assert torch.equal(ours, theirs.transpose(1, 2))
    # One value from the definition: byte 0x2F is codes 0xF (low, -6.0) then 0x2 (high, +1.0).
    one = dequantize_mxfp4(torch.tensor([[0x2F] + [0] * 15], dtype=torch.uint8), torch.tensor([129], dtype=torch.uint8),
                           torch.float32)
    assert one[:2].tolist() == [-24.0, 4.0] and not one[2:].any()



def test_gpt_oss_mxfp4_checkpoint_is_dequantized_at_load(tmp_path: Path) -> None:
    """gpt-oss as openai ships it: each layer's expert weights as MXFP4 `*_blocks` + `*_scales`
    (here random codes and exponents), everything else in bf16/fp32. Our model loaded from it
    gives the logits of HF's model holding transformers' dequantization of the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    directory = write_tiny_llama(tmp_path / "bf16", "gpt_oss", with_tokenizer=False, **GPT_OSS)
    hf = transformers.GptOssForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(7)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(experts, proj)  # HF's (E, in, out)
                e, cols, rows = param.shape  # packed as (E, out, in / 32, 16)
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
                scales = torch.randint(120, 125, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                del state[f"{prefix}.{proj}"]
                state[f"{prefix}.{proj}_blocks"], state[f"{prefix}.{proj}_scales"] = blocks, scales
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    save_file(state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(raw))
    tokens = torch.randint(0, hf.config.vocab_size, (30,), generator=g)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    _, model = load_model(packed)
    torch.testing.assert_close(full_logits(model, tokens, block_size=8), expected, atol=LOGITS_ATOL, rtol=0)


def test_mis_shaped_or_missing_expert_tensors_are_named(tmp_path: Path) -> None:
    from model.loading.checkpoint import CheckpointError

    arch, _, _, overrides = CASES["qwen3moe-mlp-only-layers-norm-topk"]
    directory = write_tiny_llama(tmp_path, arch, with_tokenizer=False, **overrides)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 16}))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \[32, 64\], "
                                              r"expected \[16, 64\]"):
        load_model(directory)
    (directory / "config.json").write_text(json.dumps({**raw, "num_experts": 9}))
    with pytest.raises(CheckpointError, match=r"missing tensors: model.layers.0.mlp.experts.8.down_proj.weight"):
        load_model(directory)
