"""Gemma 2, Gemma 3 (text) and Phi-3 checkpoints saved by HF transformers give HF's logits and
greedy continuations: alone, from the prefix cache, in a batch of 16 others and preempted.

- Gemma 2: attention and final-logit soft-capping, query_pre_attn_scalar, alternating 16-token
  windows under a 40-token prompt, (1 + weight) norms, GeGLU, scaled embeddings, tied head;
- Gemma 3: five windowed layers (8 tokens) to one global, a prompt longer than the window,
  local and global RoPE bases (the global one linearly scaled), q/k norms;
- Phi-3: fused qkv_proj / gate_up_proj, LongRoPE and partial rotary (half of each head):
  within original_max_position_embeddings against HF as it is; past it against HF's LongRoPE
  frequencies per forward (modeling_rope_utils), step by step, with HF Phi-3's own extra step
  switched off: its `generate` drops the cache at the crossing and recomputes every position
  with the long factors, which the engine does not do (model/layers/positions.py says why).
"""

from __future__ import annotations

import pytest
import torch

from model.loading.checkpoint import CheckpointError, load_model
from tiny_models import engine_greedy_runs, full_logits, hf_greedy, torch_threads, write_tiny_llama

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4
GREEDY = 32
GEMMA = dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=True, query_pre_attn_scalar=24)
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.0, 2.5, 6.0, 11.0]}
# id -> (arch, HF model class, config overrides, prompt length, forward length checked against HF's forward)
CASES = {
    "gemma2-softcap-window16": ("gemma2", "Gemma2ForCausalLM", dict(
        GEMMA, sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0), 40, 60),
    "gemma3-5to1-window8": ("gemma3", "Gemma3ForCausalLM", dict(
        GEMMA, num_hidden_layers=6, sliding_window=8, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}), 30, 60),
    "phi3-longrope-partial-within-original": ("phi3", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, max_position_embeddings=256, original_max_position_embeddings=64,
        rope_scaling=PHI3_LONGROPE), 20, 64),
    "phi3-longrope-partial-past-original": ("phi3", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_scaling=PHI3_LONGROPE), 20, 32),
}
PAST_ORIGINAL = "past-original"


def _without_phi3_cache_recompute(hf) -> None:
    """HF's generate without Phi3ForCausalLM's prepare_inputs_for_generation override (the one
    that drops the cache when the sequence first passes original_max_position_embeddings)."""
    import types

    hf.prepare_inputs_for_generation = types.MethodType(transformers.GenerationMixin.prepare_inputs_for_generation, hf)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    arch, hf_cls, overrides, prompt_len, _ = CASES[request.param]
    directory = write_tiny_llama(tmp_path_factory.mktemp(arch), arch, seed=len(request.param),
                                 with_tokenizer=False, **overrides)
    hf = getattr(transformers, hf_cls).from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    if PAST_ORIGINAL in request.param:
        _without_phi3_cache_recompute(hf)
    prompt = torch.randint(0, 301, (prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()
    return request.param, directory, hf, prompt


def test_config_is_read(case) -> None:
    name, directory, hf, _ = case
    cfg, _ = load_model(directory)
    c = hf.config
    assert cfg.arch == CASES[name][0]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert (cfg.n_layers, cfg.d_head, cfg.kv_heads) == (c.num_hidden_layers, head_dim, c.num_key_value_heads)
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    if name.startswith("gemma2"):
        assert windows == [16, None]
        assert (cfg.gemma.attn_logit_softcapping, cfg.gemma.final_logit_softcapping) == (2.0, 3.0)
    elif name.startswith("gemma3"):
        assert windows == [8] * 5 + [None]
        assert (cfg.rope_theta, cfg.gemma.rope_local_theta, cfg.rope_scaling.kind) == (1e6, 1e4, "linear")
    else:
        assert (cfg.partial_rotary_factor, cfg.rope_scaling.kind) == (0.5, "longrope")
        assert cfg.rope_scaling.original_max_position == c.original_max_position_embeddings


def test_logits_match_hf(case) -> None:
    name, directory, hf, _ = case
    _, model = load_model(directory)
    tokens = torch.randint(0, 301, (CASES[name][4],), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(full_logits(model, tokens, block_size=8), expected, atol=LOGITS_ATOL, rtol=0)


def test_greedy_matches_hf_alone_cached_batched_and_preempted(case) -> None:
    _, directory, hf, prompt = case
    expected = hf_greedy(hf, prompt, GREEDY)
    runs = engine_greedy_runs(directory, prompt, GREEDY, vocab=301)
    assert runs == dict.fromkeys(runs, expected)


@pytest.mark.parametrize("case", ["gemma2-softcap-window16"], indirect=True)
def test_soft_capping_is_what_makes_gemma2_match(case) -> None:
    """Without its two soft-caps the Gemma 2 model's logits are far from HF's: the test above
    could not pass with soft-capping ignored."""
    _, directory, hf, _ = case
    _, model = load_model(directory)
    tokens = torch.randint(0, 301, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    model.cfg = model.cfg.replace(gemma=model.cfg.gemma.__class__(model.cfg.gemma.query_pre_attn_scalar))
    for layer in model.layers:
        layer.self_attn.attn.softcap = None
    assert (full_logits(model, tokens, block_size=8) - expected).abs().max() > 0.1


@pytest.mark.parametrize("case", ["phi3-longrope-partial-past-original"], indirect=True)
def test_phi3_past_the_original_context_matches_hf_longrope_step_by_step(case) -> None:
    """LongRoPE switches to the long factors at position 32: a 20-token prompt and 32 greedy
    tokens cross it; our logits at each generated position equal HF generate's (without
    Phi-3's cache recompute at the crossing)."""
    _, directory, hf, prompt = case
    _, model = load_model(directory)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=GREEDY, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    ours = full_logits(model, prompt + tokens[:-1], block_size=8)[len(prompt) - 1:]
    torch.testing.assert_close(ours, torch.cat(out.logits), atol=LOGITS_ATOL, rtol=0)


def test_gemma3_config_without_layer_types_and_refusals(tmp_path) -> None:
    """An older Gemma 3 config.json: `sliding_window_pattern` instead of `layer_types`, and
    rope_theta / rope_local_base_freq at the top level; a multimodal config and another
    activation are refused, naming what is wrong."""
    import json

    directory = write_tiny_llama(tmp_path, "gemma3", with_tokenizer=False, num_hidden_layers=4, **GEMMA,
                                 sliding_window=8)
    raw = json.loads((directory / "config.json").read_text())
    base = {k: v for k, v in raw.items() if k not in ("layer_types", "rope_parameters")}

    def load_with(**changes):
        (directory / "config.json").write_text(json.dumps({**base, **changes}))
        return load_model(directory)[0]

    cfg = load_with(sliding_window_pattern=2, rope_theta=5e5, rope_local_base_freq=2e3)
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert (cfg.rope_theta, cfg.gemma.rope_local_theta) == (5e5, 2e3)
    with pytest.raises(CheckpointError, match="multimodal Gemma 3 checkpoint"):
        load_with(text_config={})
    with pytest.raises(CheckpointError, match="hidden_activation must be one of gelu_pytorch_tanh"):
        load_with(hidden_activation="relu")


def test_model_config_with_the_new_options_round_trips_through_json() -> None:
    """Our own config.json (save_model: dataclasses.asdict) reads back equal and hashable."""
    import dataclasses
    import json

    from model.config import GemmaOptions, ModelConfig, RopeScaling

    cfg = ModelConfig(arch="gemma3", n_layers=2, layer_types=("sliding_attention", "full_attention"),
                      sliding_window=8, gemma=GemmaOptions(24.0, 2.0, 3.0, 1e4), partial_rotary_factor=0.5,
                      rope_scaling=RopeScaling("longrope", 4.0, short_factor=(1.0, 2.0), long_factor=(3.0, 4.0)))
    back = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg and hash(back) == hash(cfg)
    assert [back.layer_window(i) for i in range(2)] == [8, None]
