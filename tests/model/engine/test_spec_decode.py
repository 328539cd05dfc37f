"""Speculative decoding (issue 27): ngram prompt lookup and a draft model inside the engine.

Greedy output must equal the plain engine's token for token (alone, in a batch beside requests
that do not speculate, under preemption, from the prefix cache), for the paper's Transformer and
a tiny Llama; sampled output must keep the target's distribution (the rejection rule on synthetic
p and q, and once through the engine); stops inside an accepted run end where the plain engine
ends; the counters count. Tiny shapes, one torch thread (as test_moe.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from model import LLM, SamplingParams  # noqa: E402
from model.config import SpeculativeConfig  # noqa: E402
from model.config import EngineConfig, ModelConfig  # noqa: E402
from model.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE  # noqa: E402
from model.engine.spec_decode.ngram import propose  # noqa: E402
from model.engine.spec_decode.rejection import greedy_accept, rejection_sample  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.models.registry import build_model  # noqa: E402
from tests.support.tiny_models import build_tiny_llama, torch_threads  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _transformer(directory: Path, like: torch.nn.Module | None = None) -> torch.nn.Module:
    """The paper's Transformer, tiny; `like` given: a copy of it with noise (a draft that agrees
    with it now and then: a one-layer cut of a post-LN stack never does)."""
    cfg = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=256)
    model = build_model(cfg)
    model.init_weights(3)
    if like is not None:
        model.load_state_dict(like.state_dict())
    torch.manual_seed(3 if like is None else 4)
    with torch.no_grad():  # noise: the bare init decodes one token forever
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if like is None else 0.01))
    save_model(model, directory)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path, int]]:
    """arch -> (target, draft, vocab size): the same vocabulary, drafts accepted some of the time.
    The Llama's draft is the target cut to its first layer."""
    root = tmp_path_factory.mktemp("spec")
    _transformer(root / "td", _transformer(root / "t"))
    out = {"transformer": (root / "t", root / "td", 300)}
    llama = build_tiny_llama(max_position_embeddings=256)
    llama.save_pretrained(root / "l")
    small = build_tiny_llama(max_position_embeddings=256, num_hidden_layers=1)
    small.load_state_dict(llama.state_dict(), strict=False)
    small.save_pretrained(root / "ld")
    out["llama"] = (root / "l", root / "ld", 301)
    return out


def _spec(method: str, draft: Path, **extra) -> dict:
    extra = {"disable_by_batch_size": 16, **extra}  # the batch tests speculate too
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **extra}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, **extra}


def _llm(target: Path, spec: dict | None = None, **engine) -> LLM:
    return LLM(str(target), device="cpu", dtype="float32",
               engine_config=EngineConfig(block_size=BLOCK, speculative_config=spec, **engine))


def _needle(vocab: int) -> list[int]:
    rng = random.Random(7)
    head = [rng.randrange(1, vocab) for _ in range(12)]
    return head + head[:6] + [rng.randrange(1, vocab) for _ in range(5)]  # repeats: ngram finds hits


def _batch(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The needle (greedy), greedy requests with penalties / min_tokens / logprobs, sampled
    requests, and one that never speculates (max_tokens 1)."""
    rng = random.Random(11)
    prompts = [_needle(vocab)] + [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 30))] for _ in range(7)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=30, **greedy),
              SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4, **greedy),
              SamplingParams(max_tokens=20, min_tokens=15, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, logit_bias={5: 3.0}, presence_penalty=0.5, **greedy),
              SamplingParams(max_tokens=1, **greedy),
              SamplingParams(max_tokens=16, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, ignore_eos=True),
              SamplingParams(max_tokens=25, **greedy)]
    return prompts, params


def _greedy_tokens(outs, params) -> list[list[int]]:
    return [o.token_ids if p.temperature == 0 else [] for o, p in zip(outs, params)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("arch", ["transformer", "llama"])
def test_greedy_identity_alone_batched_preempted_and_cached(models, arch: str, method: str) -> None:
    target, draft, vocab = models[arch]
    spec = _spec(method, draft)
    needle = _needle(vocab)
    one = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts, params = _batch(vocab)

    plain = _llm(target)
    alone = plain.generate([needle], one)[0].token_ids
    batch = plain.generate(prompts, params)
    # The prefix case: a prompt made of the needle and its output reuses the blocks that
    # speculating decode steps committed; plain recomputation gives the reference.
    follow = needle + alone + [3, 4]
    followed = _llm(target).generate([follow], one)[0].token_ids

    llm = _llm(target, spec)
    assert llm.generate([needle], one)[0].token_ids == alone
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    hits = stats.prefix_cache_hits
    assert llm.generate([follow], one)[0].token_ids == followed
    assert llm.engine.stats().prefix_cache_hits - hits >= (len(needle) + len(alone)) // BLOCK * BLOCK - BLOCK
    assert llm.generate([needle], one)[0].token_ids == alone  # again, fully cached prompt

    got = llm.generate(prompts, params)
    assert _greedy_tokens(got, params) == _greedy_tokens(batch, params)
    for a, b in zip(got[2].logprobs, batch[2].logprobs):  # logprobs of accepted tokens, from the target
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)

    tight = _llm(target, spec, num_kv_blocks=12, max_num_seqs=8)
    got = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions_total > 0
    assert tight.engine.stats().spec_decode_num_draft_tokens > 0
    assert _greedy_tokens(got, params) == _greedy_tokens(batch, params)
    assert tight.engine.scheduler.blocks.num_free == 12  # every block (proposals' too) came back


def test_ngram_proposals() -> None:
    assert propose([1, 2, 3, 9, 1, 2], 3, 1, 3) == [3, 9, 1]
    assert propose([1, 2, 3, 4], 2, 1, 3) == []  # nothing recurs
    assert propose([7, 7, 7, 7], 2, 1, 2) == [7, 7]  # a match with k tokens after it first
    assert propose([5, 1, 2, 6, 1, 2], 2, 2, 2) == [6, 1]  # the latest match


def test_greedy_accept() -> None:
    assert greedy_accept([4, 5, 6, 7], [4, 5, 9]) == [4, 5, 6]
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept: the bonus token
    assert greedy_accept([1, 5], [4]) == [1]


def _position_counts(p: torch.Tensor, q: torch.Tensor | None, fixed: list[int] | None, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    k, vocab = p.shape[0] - 1, p.shape[1]
    counts = [torch.zeros(vocab) for _ in range(k + 1)]
    drawn = None if q is None else torch.stack([torch.multinomial(q[j], n, True, generator=gen) for j in range(k)], 1)
    for i in range(n):
        props = fixed if drawn is None else drawn[i].tolist()
        for j, tok in enumerate(rejection_sample(p, props, q, gen)):
            counts[j][tok] += 1
    return counts


@pytest.mark.parametrize("kind", ["draft", "point_mass"])
def test_rejection_sampling_keeps_the_target_distribution(kind: str) -> None:
    """20k runs: the token emitted at each position is distributed as p there (chi-square)."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1) if kind == "draft" else None
    counts = _position_counts(p, q, [int(p[0].argmax()), int(p[1].argmax())], 20_000)
    for j in range(k + 1):
        n = float(counts[j].sum())
        assert n > 2000  # the position was reached often enough to test
        assert chisquare(counts[j].numpy(), (p[j] * n).numpy()).pvalue > 1e-3
    # q's own distribution is not p's: the test can tell them apart
    if q is not None:
        n = float(counts[0].sum())
        assert chisquare(counts[0].numpy(), (q[0] * n).numpy()).pvalue < 1e-6


def test_sampled_engine_output_keeps_the_target_distribution(models) -> None:
    """Through the engine with a draft model: the joint law of output tokens 1 and 2 (token 2
    verified against one draft proposal) equals the target's p(t1) p(t2 | t1) under top_k 2."""
    target, draft, vocab = models["llama"]
    prompt = _needle(vocab)
    hf = build_tiny_llama(max_position_embeddings=256)  # the weights of `target`
    top = SamplingParams(max_tokens=3, temperature=1.0, top_k=2, ignore_eos=True)

    def top3(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        vals, idx = logits.topk(2)
        return torch.zeros(vocab).scatter(0, idx, torch.softmax(vals, -1))

    p1 = top3(prompt)
    expected = {}
    for t1 in p1.nonzero().view(-1).tolist():
        p2 = top3(prompt + [t1])
        for t2 in p2.nonzero().view(-1).tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    torch.manual_seed(0)
    llm = _llm(target, _spec("draft", draft, disable_by_batch_size=64))
    n = 1500
    outs = llm.generate([prompt] * n, top)
    assert llm.engine.stats().spec_decode_num_draft_tokens >= n  # token 2 was verified, not decoded
    seen = {key: 0 for key in expected}
    for o in outs:
        seen[tuple(o.token_ids[:2])] += 1
    cells = list(expected)
    total = sum(expected.values())
    assert chisquare([seen[c] for c in cells], [expected[c] / total * n for c in cells]).pvalue > 1e-3


def test_stops_inside_an_accepted_run_end_where_the_plain_engine_ends(models) -> None:
    """The target drafting for itself accepts everything, so every stop lands mid-run."""
    target, _draft, vocab = models["llama"]
    needle = _needle(vocab)
    plain, spec = _llm(target), _llm(target, _spec("draft", target))
    full = plain.generate([needle], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    cases = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (2, 3, 5, 6, 9)]
    cases.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[full.token_ids[6]]))
    text = full.text
    cases.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[text[len(text) // 2:][:3]]))
    last_sizes = []
    for i, params in enumerate(cases):
        a = plain.generate([needle], params)[0]
        spec.engine.add_request(f"r{i}", needle, params)
        toks, text, last = [], "", None
        while spec.engine.has_unfinished():
            for last in spec.engine.step():
                toks += last.new_token_ids
                text += last.new_text
        assert (toks, text, last.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
        last_sizes.append(len(last.new_token_ids))
    assert cases[-1].stop and a.finish_reason == "stop" and text  # the stop string matched
    st = spec.engine.stats()
    assert st.spec_decode_num_accepted_tokens == st.spec_decode_num_draft_tokens > 0
    assert max(last_sizes[-2:]) > 1  # a stop ended a step that had delivered tokens before it


def test_counters_and_backoff(models) -> None:
    target, _draft, vocab = models["transformer"]
    llm = LLM(str(target), device="cpu", dtype="float32", speculative_config=_spec("ngram", target, disable_by_batch_size=2))
    assert llm.engine.spec is not None  # the LLM argument
    st = llm.engine.stats()
    assert st.spec_decode_num_draft_tokens == 0 and st.spec_decode_num_accepted_per_position == (0, 0, 0, 0)
    rep = [5, 6, 7, 8, 9] * 6
    llm.generate([rep], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    st = llm.engine.stats()
    assert st.spec_decode_num_accepted_tokens > 0
    assert sum(st.spec_decode_num_accepted_per_position) == st.spec_decode_num_accepted_tokens
    assert sum(st.spec_decode_num_drafts_per_position) == st.spec_decode_num_draft_tokens
    assert all(a <= d for a, d in zip(st.spec_decode_num_accepted_per_position, st.spec_decode_num_drafts_per_position))
    # The service's export (service/engine/metrics.py): counters get the totals' increments, the gauge
    # the rate per position (Ray's metric objects, their inc/set recorded)
    from service.engine.metrics import EngineMetrics

    metrics, calls = EngineMetrics("tiny"), []
    assert metrics.spec_drafts._name == "qkv_spec_decode_num_draft_tokens_total"
    assert metrics.spec_accepted._name == "qkv_spec_decode_num_accepted_tokens_total"
    metrics.spec_drafts.inc = lambda v, tags=None: calls.append(("drafts", v))
    metrics.spec_accepted.inc = lambda v, tags=None: calls.append(("accepted", v))
    metrics.spec_rate.set = lambda v, tags=None: calls.append((tags["position"], v))
    metrics.refresh(st)
    metrics.refresh(st)  # nothing new: no increment
    assert ("drafts", st.spec_decode_num_draft_tokens) in calls and ("accepted", st.spec_decode_num_accepted_tokens) in calls
    assert sum(1 for c in calls if c[0] == "drafts") == 1
    assert ("0", st.spec_decode_num_accepted_per_position[0] / st.spec_decode_num_drafts_per_position[0]) in calls
    before = st.spec_decode_num_draft_tokens  # a batch of 3 > disable_by_batch_size: no speculation
    llm.generate([rep] * 3, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert llm.engine.stats().spec_decode_num_draft_tokens == before


def test_speculative_config_is_validated(models) -> None:
    bad = [({"method": "medusa", "num_speculative_tokens": 2}, "method"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1, got None"),
           ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "4"}, "prompt_lookup_max"),
           ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size")]
    for raw, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=raw)
    assert SpeculativeConfig.parse(None) is None
    for method, extra in (("ngram", {}), ("draft_model", {"model": "d"})):  # each method's measured back-off
        parsed = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 3, **extra})
        assert parsed.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE[method]
        assert SpeculativeConfig.parse(SpeculativeConfig(method, 3, **extra)) == parsed
    from service.app import AppArgs  # the app argument reaches EngineConfig, checked there

    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineConfig(**AppArgs(speculative_config=spec).engine_config()).speculative_config == spec
    with pytest.raises(ValueError, match="method"):
        EngineConfig(**AppArgs(speculative_config={"method": "eagle", "num_speculative_tokens": 3}).engine_config())
    target, _draft, _vocab = models["transformer"]
    _l, llama_draft, _v = models["llama"]
    with pytest.raises(ValueError, match="vocabulary"):  # 301 tokens drafting for 300: refused at start-up
        _llm(target, _spec("draft", llama_draft))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_sampled_request_repeats_under_speculation(models, method: str) -> None:
    """Seeded: the same tokens from two engines (the draft draws from the request's generator
    too). Not the tokens of the non-speculative engine: the rule draws differently (docs/features/speculative-decoding.md)."""
    target, draft, vocab = models["llama"]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = _llm(target, _spec(method, draft))
        runs.append(llm.generate([_needle(vocab)], params)[0].token_ids)
        assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    assert runs[0] == runs[1] and len(runs[0]) == 24
