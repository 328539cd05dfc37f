"""Gemma 2, Gemma 3 (text) and Phi-3 checkpoints saved by HF transformers give HF's logits and
greedy continuations: alone, from the prefix cache, in a batch of 16 others and preempted.

- Gemma 2: attention and final-logit soft-capping, query_pre_attn_scalar, alternating 16-token
  windows under a 40-token prompt, (1 + weight) norms, GeGLU, scaled embeddings, tied head;
- Gemma 3: five windowed layers (8 tokens) to one global, a prompt longer than the window,
  local and global RoPE bases (the global one linearly scaled), q/k norms;
- Phi-3: fused qkv_proj / gate_up_proj, LongRoPE and partial rotary (half of each head):
  within original_max_position_embeddings; a 20-token prompt whose 32 greedy tokens cross it,
  against HF's own generate, which drops its cache at the crossing and recomputes every position
  with the long factors (Phi3ForCausalLM.prepare_inputs_for_generation), as the engine's
  scheduler does, alone, batched, cached, preempted and speculating; a prompt longer than the
  original context, rotated long throughout; and the prefix cache never handing the K/V of one
  regime to a sequence of the other.
"""

from __future__ import annotations

import pytest
import torch

from model.loading.checkpoint import CheckpointError, load_model
from tests.support.tiny_models import one_thread  # noqa: F401  (autouse: this module runs on one torch thread)
from tests.support.tiny_models import engine_greedy_runs, full_logits, hf_greedy, write_tiny_llama
from tests.support.requirements import need_module

transformers = need_module("transformers")

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
    "phi3-longrope-prompt-past-original": ("phi3", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.5, max_position_embeddings=128, original_max_position_embeddings=32,
        rope_scaling=PHI3_LONGROPE), 40, 40),
}
CROSSING = "phi3-longrope-partial-past-original"


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    arch, hf_cls, overrides, prompt_len, _ = CASES[request.param]
    directory = write_tiny_llama(tmp_path_factory.mktemp(arch), arch, seed=len(request.param),
                                 with_tokenizer=False, **overrides)
    hf = getattr(transformers, hf_cls).from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
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
    ours = full_logits(model, tokens, block_size=8, rope_len=len(tokens) if _longer_than_original(hf, len(tokens)) else 0)
    torch.testing.assert_close(ours, expected, atol=LOGITS_ATOL, rtol=0)


def _longer_than_original(hf, length: int) -> bool:
    """Whether HF's forward over `length` tokens takes LongRoPE's long factors at every position."""
    original = getattr(hf.config, "original_max_position_embeddings", None) if hf.config.model_type == "phi3" else None
    return original is not None and length > original


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


def _phi3_hf(directory, recompute: bool = True):
    hf = transformers.Phi3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    if not recompute:  # HF's generate without Phi-3's cache drop at the crossing
        import types

        hf.prepare_inputs_for_generation = types.MethodType(transformers.GenerationMixin.prepare_inputs_for_generation, hf)
    return hf


def _llm(directory, **engine):
    from model import LLM
    from model.config import EngineConfig

    return LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(block_size=8, **engine))


def _greedy(n: int = GREEDY):
    from model import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("case", [CROSSING], indirect=True)
def test_phi3_crossing_the_original_context_recomputes_as_hf_generate_does(case) -> None:
    """At the crossing HF Phi-3 recomputes everything with the long factors; the greedy
    continuation without that recompute differs (so the parity test above needs it), and the
    engine recomputed the sequence once, also when speculating (ngram proposals stop short of
    the crossing: HF verifies none of them against short-regime K/V)."""
    _, directory, hf, prompt = case
    expected = hf_greedy(hf, prompt, GREEDY)
    assert hf_greedy(_phi3_hf(directory, recompute=False), prompt, GREEDY) != expected
    llm = _llm(directory)
    assert llm.generate([prompt], _greedy())[0].token_ids == expected
    assert llm.engine.scheduler.num_rope_recomputes == 1
    assert llm.engine.stats().num_preemptions_total == 0  # a recompute is not a preemption
    spec = _llm(directory, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                               "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    assert spec.generate([prompt], _greedy())[0].token_ids == expected
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("case", ["phi3-longrope-prompt-past-original"], indirect=True)
def test_phi3_prompt_past_the_original_context_is_rotated_long_throughout(case) -> None:
    """HF's forward over a 40-token prompt (original context 32) rotates all of it long;
    rotating only the positions past 32 long (the per-position rule) is far off it."""
    name, directory, hf, _ = case
    _, model = load_model(directory)
    tokens = torch.randint(0, 301, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    assert (full_logits(model, tokens, block_size=8) - expected).abs().max() > 0.1


@pytest.mark.parametrize("case", [CROSSING], indirect=True)
def test_phi3_prefix_cache_keeps_short_and_long_regimes_apart(case) -> None:
    """A short prompt's blocks are cached short; a 40-token prompt starting with it (rotated
    long) must not take them, nor the short prompt (again) the long one's; both equal HF."""
    _, directory, hf, prompt = case
    longer = prompt + torch.randint(0, 301, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    expected_short, expected_long = hf_greedy(hf, prompt, 8), hf_greedy(hf, longer, 8)
    llm = _llm(directory)
    assert llm.generate([prompt], _greedy(8))[0].token_ids == expected_short
    hits = llm.engine.stats().prefix_cache_hits
    assert llm.generate([longer], _greedy(8))[0].token_ids == expected_long
    assert llm.engine.stats().prefix_cache_hits == hits  # nothing of the short regime reused
    out = llm.generate([prompt, longer], _greedy(8))
    assert [o.token_ids for o in out] == [expected_short, expected_long]
    assert llm.engine.stats().prefix_cache_hits - hits >= 16 + 32  # each regime found its own blocks


def test_scheduler_recomputes_a_sequence_crossing_the_original_context_in_the_same_step() -> None:
    """The scheduler's side (no torch): a sequence longer than the original context (8) on
    arrival is long; one growing past it is dropped and recomputed long from position 0 in the
    step it crosses, under new block hashes, without counting as a preemption; speculation room
    ends at the crossing."""
    from model import SamplingParams
    from model.engine.kv.block_manager import BlockManager
    from model.engine.scheduler import Scheduler
    from model.engine.sequence import Sequence

    sched = Scheduler(BlockManager(16, 4, enable_prefix_caching=True), 4, 64, rope_long_from=8, rope_recompute=True)
    short, long = Sequence("s", list(range(50, 56)), SamplingParams(max_tokens=8)), \
        Sequence("l", list(range(9)), SamplingParams(max_tokens=8))
    sched.add(short)
    sched.add(long)
    assert (short.rope_len, long.rope_len) == (0, 9)  # every long sequence: original + 1
    assert (sched.tokens_before_recompute(short), sched.tokens_before_recompute(long)) == (2, None)
    steps = []
    for token in (100, 101, 102):  # 6 -> 9 tokens: the third step's sequence crossed
        out = sched.schedule()
        steps.append({s.seq.request_id: (s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled})
        sched.computed(out)
        short_hashes = list(short.block_hashes)
        for seq in (short, long):
            seq.output_token_ids.append(token)
    out = sched.schedule()
    steps.append({s.seq.request_id: (s.seq.num_computed_tokens, s.num_new_tokens) for s in out.scheduled})
    assert steps == [{"s": (0, 6), "l": (0, 9)}, {"s": (6, 1), "l": (9, 1)}, {"s": (7, 1), "l": (10, 1)},
                     {"l": (11, 1), "s": (0, 9)}]
    assert short.rope_len == 9 and sched.num_rope_recomputes == 1 and sched.num_preemptions == 0
    assert sched.blocks.hashes(short)[:2] != short_hashes[:2] and len(short_hashes) == 2


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
