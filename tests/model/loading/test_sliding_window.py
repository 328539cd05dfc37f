"""Sliding-window attention against HF transformers: a Mistral checkpoint with a 64-token window
over a 200-token prompt gives HF's logits and greedy continuation (alone, from the prefix cache,
in a batch, under preemption); the fused kernels and the gather path agree with windows; Qwen2's
`max_window_layers` mixes windowed and full layers.
"""

from __future__ import annotations

import pytest
import torch

from model.layers import paged_attention as pa
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.loading.checkpoint import load_model
from tests.support.tiny_models import one_thread  # noqa: F401  (autouse: this module runs on one torch thread)
from tests.support.tiny_models import engine_greedy_runs, full_logits, hf_greedy, write_tiny_llama
from tests.support.requirements import required
from tests.support.requirements import need_module

transformers = need_module("transformers")

LOGITS_ATOL = 1e-4
WINDOW, PROMPT, GREEDY = 64, 200, 32



@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral checkpoint with a 64-token window, HF's model read back from it, a prompt of 200."""
    directory = write_tiny_llama(tmp_path_factory.mktemp("mistral-window"), "mistral", seed=7,
                                 sliding_window=WINDOW, max_position_embeddings=256, with_tokenizer=False)
    hf = transformers.MistralForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    prompt = torch.randint(0, 301, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    return directory, hf, prompt


def test_mistral_window_logits_match_hf(mistral) -> None:
    directory, hf, prompt = mistral
    cfg, model = load_model(directory)
    assert [cfg.layer_window(i) for i in range(cfg.n_layers)] == [WINDOW] * cfg.n_layers
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = full_logits(model, prompt, block_size=8)
    torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)
    # The window matters here: positions past it differ from full attention.
    full = load_model(directory)[1]
    for layer in full.layers:
        layer.self_attn.attn.window = None
    assert (full_logits(full, prompt, block_size=8)[WINDOW:] - expected[WINDOW:]).abs().max() > 1e-2


def test_mistral_window_greedy_matches_hf_alone_batched_preempted_and_cached(mistral) -> None:
    directory, hf, prompt = mistral
    expected = hf_greedy(hf, prompt, GREEDY)
    # Out-of-window blocks are given back as decoding moves on: the pool is the least that admits
    # the request (29 blocks of 8), with short steps, for a preemption to happen.
    runs = engine_greedy_runs(directory, prompt, GREEDY, vocab=301,
                              preemption_engine={"num_kv_blocks": 29, "max_num_batched_tokens": 64})
    assert runs == dict.fromkeys(runs, expected)


def _held(seq) -> int:
    return len(seq.block_table) - seq.num_released_blocks


@pytest.mark.parametrize("backend", ["gather", "fused", "flex"])
def test_mistral_out_of_window_blocks_are_given_back_and_outputs_stay_exact(mistral, backend) -> None:
    """Every layer windowed (64): a sequence holds at most window / block_size + 2 blocks once it
    decodes (not its whole length), on the gather path (which reads the released entries' null
    block under its mask), the fused kernel and FlexAttention (whose inverse block table maps the
    null block to a masked position); HF's tokens still."""
    from model import LLM, SamplingParams
    from model.config import EngineConfig
    from model.layers.paged_attention import use_fused

    if backend == "fused" and not use_fused(torch.device("cpu")):
        required(False, "the fused CPU kernel is not built here")
    directory, hf, prompt = mistral
    expected = hf_greedy(hf, prompt, GREEDY)
    llm = LLM(str(directory), device="cpu", dtype="float32",
              engine_config=EngineConfig(block_size=8, attention_backend=backend))
    engine = llm.engine
    engine.add_request("w", prompt, SamplingParams(max_tokens=GREEDY, temperature=0, ignore_eos=True))
    held, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        held += [_held(s) for s in engine.scheduler.running]
    assert tokens == expected
    assert max(held[1:]) <= WINDOW // 8 + 2 < held[0] == 25  # after the 200-token prefill
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks  # all back at the end


def test_mistral_released_blocks_under_preemption_and_speculation(mistral, monkeypatch) -> None:
    """A windowed sequence preempted after it gave blocks back (four others arrive first and
    grow in a pool of 29 until the newest, it, is preempted) is recomputed to HF's tokens, and a
    speculating run (ngram) past the window equals HF too."""
    from model import LLM, SamplingParams
    from model.config import EngineConfig
    from model.engine.scheduler import Scheduler

    directory, hf, prompt = mistral
    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq, out: (
        preempted.append((seq.request_id, seq.num_released_blocks)), preempt(self, seq, out)))
    longer = torch.randint(0, 301, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    others = [[(7 * i + j) % 301 for j in range(8)] for i in range(4)]
    llm = LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(block_size=8, num_kv_blocks=29))
    outs = llm.generate(others + [longer], [SamplingParams(max_tokens=56, temperature=0, ignore_eos=True)] * 4
                        + [SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)])
    assert outs[4].token_ids == hf_greedy(hf, longer, 80)
    # Only the 150-token sequence outgrows the window (the others end at 64 tokens): it is the one.
    assert any(released > 0 for _, released in preempted), preempted
    greedy = SamplingParams(max_tokens=GREEDY, temperature=0, ignore_eos=True)
    spec = LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(
        block_size=8, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3}))
    assert spec.generate([prompt, prompt], greedy)[1].token_ids == hf_greedy(hf, prompt, GREEDY)
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0


def test_qwen2_max_window_layers_mix_windowed_and_full_layers(tmp_path) -> None:
    """Qwen2 with use_sliding_window: layers from max_window_layers on have the window."""
    directory = write_tiny_llama(tmp_path, "qwen2", seed=3, use_sliding_window=True, sliding_window=16,
                                 max_window_layers=1, max_position_embeddings=128, with_tokenizer=False)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    cfg, model = load_model(directory)
    assert [cfg.layer_window(i) for i in range(cfg.n_layers)] == [None, 16]
    tokens = torch.randint(0, 301, (60,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(full_logits(model, tokens, block_size=8), expected, atol=LOGITS_ATOL, rtol=0)


# ---- the fused kernels against the gather path, with windows ----------------------------


@pytest.mark.parametrize("window", [None, 1, 5, 16, 33, 500])
def test_fused_kernels_equal_the_gather_path_with_windows(window) -> None:
    required(pa.kernel_available(), "the fused kernel could not be built here")
    g = torch.Generator().manual_seed(0)
    nb, bs, hkv, d, hq = 40, 4, 2, 16, 6
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    tables = torch.stack([torch.randperm(nb, generator=g)[:12] for _ in range(4)])  # scattered blocks
    ctx = torch.tensor([1, 6, 29, 48])
    q = torch.randn(4, hq, d, generator=g)
    torch.testing.assert_close(pa.paged_decode_attention(q, kc, vc, tables, ctx, 0.3, window),
                               pa.gather_decode_attention(q, kc, vc, tables, ctx, 0.3, window), atol=1e-5, rtol=0)
    q = torch.randn(9, hq, d, generator=g)
    torch.testing.assert_close(pa.paged_prefill_attention(q, kc, vc, tables[2], 41, 0.3, window),
                               pa.gather_prefill_attention(q, kc, vc, tables[2], 41, 0.3, window), atol=1e-5, rtol=0)


def test_windowed_gather_reference_is_a_band_of_plain_attention() -> None:
    """The reference itself: a window of w keeps exactly the last w keys (HF: i - w < j <= i)."""
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(8, 4, 1, 8, generator=g), torch.randn(8, 4, 1, 8, generator=g)
    table, q = torch.arange(8)[None], torch.randn(1, 2, 8, generator=g)
    n, w = 19, 5
    ref = torch.softmax(torch.einsum("hd,nd->hn", q[0], kc.flatten(0, 1)[n - w:n, 0]) * 0.5, -1)
    expected = ref @ vc.flatten(0, 1)[n - w:n, 0]
    got = pa.gather_decode_attention(q, kc, vc, table, torch.tensor([n]), 0.5, w)[0]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@torch.no_grad()
def test_model_decode_through_the_kernel_equals_the_gather_path_with_windows(mistral) -> None:
    """The whole model's decode step (every layer windowed, context past the window) with the
    runner's fused kernels in the metadata and without."""
    required(pa.kernel_available(), "the fused kernel could not be built here")
    directory, _, prompt = mistral
    cfg, model = load_model(directory)
    bs, n = 8, 150
    tokens = torch.tensor(prompt[: n + 1])
    table = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:20]

    def decode_logits(fused: bool) -> torch.Tensor:
        cache = KVCache(cfg.n_layers, 40, bs, cfg.kv_heads, cfg.d_head, torch.float32, "cpu")
        pos = torch.arange(n)
        chunks = [(0, 100), (100, 10), (110, 40)]  # a fresh prefill, a short and a long chunk after a past
        for start, length in chunks:
            p = pos[start:start + length]
            meta = AttnMetadata(slot_mapping=table[p // bs] * bs + p % bs,
                                prefills=[PrefillChunk(0, length, start + length, table)],
                                prefill_kernel=pa.paged_prefill_attention if fused else None)
            model(tokens[start:start + length], p, meta, cache)
        meta = AttnMetadata(slot_mapping=(table[n // bs] * bs + n % bs).view(1), num_decode=1,
                            decode_block_tables=table[None], decode_context_lens=torch.tensor([n + 1]),
                            decode_max_context=n + 1, decode_kernel=pa.paged_decode_attention if fused else None)
        return model.compute_logits(model(tokens[n:], torch.tensor([n]), meta, cache))

    torch.testing.assert_close(decode_logits(True), decode_logits(False), atol=1e-5, rtol=0)
    with_full = full_logits(model, tokens, block_size=bs)[-1:]
    torch.testing.assert_close(decode_logits(False), with_full, atol=1e-5, rtol=0)
