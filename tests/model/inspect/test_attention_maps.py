"""Per-head attention weights (`LLM.attention`): equal to HF's eager `output_attentions` for
GPT-2, a grouped-query Llama, Gemma 2 (soft-capping, a sliding window) and gpt-oss (sinks, a
sliding window), equal to references written here for the paper's dot and
additive attention, `scale: "none"` changes only the scaling, and requests beside an
attention request produce exactly what they produce alone."""

from __future__ import annotations

import math

import pytest
import torch

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.inspect.attention_spec import AttentionRequestError, AttentionShape, AttentionSpec, check_attention
from tests.support.tiny_models import save_tiny_gpt2, write_tiny_llama

ENGINE = EngineConfig(num_kv_blocks=64, max_num_seqs=8)
PROMPT = "The cat sat on the mat. 猫🙂"


def _hf_weights(path: str, ids: list[int]) -> torch.Tensor:
    """HF transformers' eager attention weights: (layers, heads, T, T)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_attentions=True)
    return torch.stack([a[0] for a in out.attentions])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_weights_equal_hf_eager(tmp_path, arch):
    path = str(save_tiny_gpt2(tmp_path) if arch == "gpt2" else write_tiny_llama(tmp_path))  # llama: 4 q / 2 kv heads
    llm = LLM(path, dtype="float32", engine_config=ENGINE)
    ids = llm.tokenizer.encode(PROMPT)
    ours = llm.attention(ids)
    ref = _hf_weights(path, ids)
    assert ours.shape == ref.shape == (2, ref.shape[1], len(ids), len(ids))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    # A subset of layers, heads and rows is the same numbers.
    part = llm.attention(ids, layers=[1], heads=[3, 0] if arch == "llama" else [1], rows=[0, len(ids) - 1])
    heads = [3, 0] if arch == "llama" else [1]
    torch.testing.assert_close(part, ref[[1]][:, heads][:, :, [0, len(ids) - 1]], atol=1e-5, rtol=0)
    # Generated rows: the weights of the prompt plus 3 greedy tokens equal HF's on those tokens.
    maps = llm.attention_maps(ids, rows="last", max_tokens=3)
    gen = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    assert maps.token_ids == ids + gen
    torch.testing.assert_close(maps.weights, _hf_weights(path, ids + gen)[:, :, -1:], atol=1e-5, rtol=0)


# What the layer's attention does beyond softmax(q.k * scale), checked against HF's eager weights:
# Gemma 2 (soft-capped scores, query_pre_attn_scalar, an 8-token window on layer 0 of a 20-token
# prompt) and gpt-oss (sink logits in each softmax's denominator, the same window).
WINDOWED = {
    "gemma2": dict(head_dim=16, tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=8,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16, sliding_window=8),
}


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_windowed_softcapped_and_sink_weights_equal_hf_eager(tmp_path, arch):
    path = str(write_tiny_llama(tmp_path, arch, seed=5, with_tokenizer=False, **WINDOWED[arch]))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    if arch == "gpt_oss":  # HF initialises sinks to 0 (a constant shift): make them differ per head
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
        hf.save_pretrained(path)
    ids = torch.randint(0, 301, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions])
    ours = LLM(path, dtype="float32", engine_config=ENGINE).attention(ids)
    assert ours.shape == ref.shape == (2, 4, 20, 20)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert (ours[0].tril(-8) == 0).all() and (ours[1].tril(-8) > 0).any()  # layer 0 windowed, layer 1 global
    if arch == "gpt_oss":
        assert (ours.sum(-1) < 1 - 1e-3).all()  # the sinks took their share of every row
    else:
        assert (ours.sum(-1) - 1).abs().max() < 1e-5


def _layer_inputs(llm: LLM) -> dict[int, torch.Tensor]:
    """Each block's attention input (T, d_model), recorded by hooks during the next forward."""
    seen: dict[int, torch.Tensor] = {}
    for i, block in enumerate(llm.engine.runner.model.blocks):
        block.attn.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[0].detach().clone()))
    return seen


@torch.no_grad()
def _reference(attn: torch.nn.Module, x: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QK^T/sqrt(d_k)) or softmax(v^T tanh(W_q q + W_k k)) from the layer's own
    projections, causal: weights and pre-softmax scores, (H, T, T)."""
    t, h, d = x.shape[0], attn.n_heads, attn.d_head
    q, k, _ = attn.qkv(x).view(t, 3, h, d).unbind(1)  # (T, H, d)
    if hasattr(attn.score, "w_q"):
        qp = torch.einsum("thd,hde->hte", q, attn.score.w_q)  # (H, T, d)
        kp = torch.einsum("thd,hde->hte", k, attn.score.w_k)
        scores = torch.einsum("hqkd,hd->hqk", torch.tanh(qp[:, :, None] + kp[:, None]), attn.score.v)
    else:
        scores = torch.einsum("qhd,khd->hqk", q, k) / (math.sqrt(d) if scaled else 1.0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, -1), scores


@pytest.mark.parametrize("preset", ["transformer-base", "transformer-base-additive"])
def test_paper_weights_equal_reference(preset):
    llm = LLM(preset, dtype="float32", engine_config=ENGINE)
    inputs = _layer_inputs(llm)
    maps = llm.attention_maps(PROMPT, layers=[0, 5], heads=[0, 3, 7])
    assert maps.shape.kind == ("additive" if preset.endswith("additive") else "dot")
    blocks = llm.engine.runner.model.blocks
    for li, layer in enumerate([0, 5]):
        ref, scores = _reference(blocks[layer].attn, inputs[layer])
        torch.testing.assert_close(maps.weights[li], ref[[0, 3, 7]], atol=1e-5, rtol=0)
        visible = scores[[0, 3, 7]][:, torch.ones(scores.shape[1], scores.shape[1], dtype=torch.bool).tril()]
        torch.testing.assert_close(maps.score_std[li], visible.std(-1, unbiased=False), atol=1e-5, rtol=1e-4)
    assert torch.allclose(maps.weights.sum(-1), torch.ones(()), atol=1e-5)
    assert (maps.weights.triu(1) == 0).all()  # keys after a row's position are exactly 0


def test_unscaled_scores_saturate():
    llm = LLM("transformer-base", dtype="float32", engine_config=ENGINE)
    inputs = _layer_inputs(llm)
    scaled = llm.attention_maps(PROMPT)
    unscaled = llm.attention_maps(PROMPT, scale="none")
    # Only the scaling changed: the unscaled weights are the reference without 1/sqrt(d_k)
    # over the very same hidden states, and every score std grows by sqrt(d_k) = 8.
    ref, _ = _reference(llm.engine.runner.model.blocks[2].attn, inputs[2], scaled=False)
    torch.testing.assert_close(unscaled.weights[2], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(unscaled.score_std / scaled.score_std, torch.full_like(scaled.score_std, 8.0))
    # Saturation: the mean max row weight moves toward 1 and the rows' entropy falls.
    last_rows = slice(8, None)  # rows that see at least 9 keys
    max_scaled = scaled.weights[:, :, last_rows].amax(-1).mean()
    max_unscaled = unscaled.weights[:, :, last_rows].amax(-1).mean()
    assert max_unscaled > max_scaled + 0.1
    assert (unscaled.entropy < scaled.entropy).all()


def test_neighbours_unchanged_by_an_attention_request():
    llm = LLM("transformer-base", dtype="float32", engine_config=ENGINE)
    prompts = ["Hello there", "A longer prompt that runs beside the others", "x"]
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=5, temperature=0.8, seed=3),
              SamplingParams(max_tokens=4, temperature=0.0)]
    alone = [o.token_ids for o in llm.generate(prompts, params)]
    eng = llm.engine
    ids = [llm.tokenizer.encode(p) for p in prompts]
    eng.add_request("attn", llm.tokenizer.encode(PROMPT),
                    SamplingParams(max_tokens=3, temperature=0.0, attention=AttentionSpec(max_tokens=3)))
    for i, (p, sp) in enumerate(zip(ids, params)):
        eng.add_request(f"n{i}", p, sp)
    got: dict[str, list[int]] = {f"n{i}": [] for i in range(3)}
    maps = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == "attn":
                maps = out.attention if out.finished else maps
            else:
                got[out.request_id].extend(out.new_token_ids)
                assert out.attention is None
    assert [got[f"n{i}"] for i in range(3)] == alone
    n = len(llm.tokenizer.encode(PROMPT)) + 3
    assert maps is not None and maps.weights.shape == (6, 8, n, n)


def test_check_attention_errors():
    shape = AttentionShape("additive", 6, 8, 8, 64)
    with pytest.raises(AttentionRequestError, match="dot-product attention only") as e:
        check_attention(AttentionSpec(scale="none"), shape, 5)
    assert e.value.param == "scale"
    for spec, param in [(AttentionSpec(layers=(6,)), "layers"), (AttentionSpec(heads=()), "heads"),
                        (AttentionSpec(rows=(9,)), "rows"), (AttentionSpec(rows="first"), "rows")]:
        with pytest.raises(AttentionRequestError) as e:
            check_attention(spec, shape, 5, max_floats=None)
        assert e.value.param == param
    assert check_attention(AttentionSpec(rows=(9,), max_tokens=5), shape, 5) == 6 * 8 * 1 * 10
    with pytest.raises(AttentionRequestError, match="limit is 100 .*fewer layers, heads or rows"):
        check_attention(AttentionSpec(), shape, 5, max_floats=100)
