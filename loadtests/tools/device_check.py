"""The GPU device check: one command, the project and torch for CUDA only (no Ray, nothing from
service/), about 5-8 minutes on an H200. Writes one JSON and prints one table.

    python loadtests/tools/device_check.py                   # on the GPU machine
    python loadtests/tools/device_check.py --dry-run         # the same sequence on the CPU, tiny shapes

Checks, in order (each one's failure is recorded and the next still runs; what a check could not
check, e.g. without `transformers` or past the time budget, is a failure, not a pass):
1. parity: greedy tokens of tiny random Llama, Qwen3 and GPT-2 models (built here with
   `transformers`, no downloads) from the engine against HF `generate` on the same device in
   bfloat16; the paper's Transformer (no HF class) against its own dense no-cache forward.
   In bf16 two correct implementations may part at a near-tie, so a difference passes only
   when HF's top-two logits at that step are within `TIE`.
2. batch invariance: a prompt alone and in a batch of 16 gives the same greedy tokens (float32).
3. backends: the flex kernels (compiled on CUDA) against the engine's own gather path (ragged
   decode, padded prefill chunks after a cached past in a row that owns block 0, block tables
   with holes, GQA, windows, bf16/fp16 caches),
   and the engine's greedy tokens with flex and gather.
4. graphs: greedy tokens with CUDA graphs (enforce_eager off) and without, equal, and captured
   (replayed, no fallback to eager) on CUDA.
5. sampling: sampled requests (temperature, top-k/p, penalties, logit bias, min_tokens, logprobs,
   seeds) on the device: each runs to its length, a -100 bias is never sampled, a seeded request
   draws the same tokens alone and in a batch.
6. prefix_cache: a prompt again (its full blocks cached) and prompts that share a prefix with short
   tails (a short prefill chunk after a cached past, the padded flex path), equal to the same
   requests with the prefix cache off.
7. spec_decode: ngram and draft-model speculation, greedy, equal to plain decoding, with drafts
   proposed.
8. long_context: a long-context engine (flex, decode graphs, many sequences): no gather workspace
   reserved for flex decode, and on CUDA the peak memory beyond the weights and the KV pool stays
   small (the workspace alone was max_num_seqs x the context's blocks).
9. throughput: a Llama-3.1-8B-shaped model with random bf16 weights decoding at batch 1, 64 and
   256 over a 2k context (distinct KV blocks per sequence, no prefix sharing), against the
   roofline (weight + KV bytes per step over 4.8 TB/s, FLOPs over 790 TFLOP/s) and against HF
   `generate` on the same weights (its decode steps timed by a logits processor).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import logging
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtests.tools import results  # noqa: E402
from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig, ModelConfig  # noqa: E402
from model.engine.scheduler import ScheduledSeq  # noqa: E402
from model.engine.sequence import Sequence  # noqa: E402
from model.layers.attention import DotScore, PagedAttention  # noqa: E402
from model.layers.flex_attention import FlexPagedAttention  # noqa: E402
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk  # noqa: E402
from model.sampling.sampler import SamplingRow  # noqa: E402

logger = logging.getLogger("device_check")
TIE = 0.05  # bf16 near-tie: HF's top-two logits closer than this (relative to max(1, |top1|))
HBM_BYTES_PER_S = 4.8e12  # H200
PEAK_FLOPS = 790e12  # H200 dense bf16, about


@dataclass(frozen=True)
class Sizes:
    device: str
    dtype: torch.dtype
    parity_tokens: int
    big: dict  # transformers LlamaConfig fields of the throughput model
    batches: tuple[int, ...]
    context: int
    steps: int  # timed decode steps per batch
    kernel_context: int  # longest context in the backend check
    block_size: int = 16
    num_prompts: int = 4  # per engine run of the correctness checks
    # (cache dtype, window): each case compiles three flex kernels (decode, two chunk lengths)
    kernel_cases: tuple = ((torch.bfloat16, None), (torch.bfloat16, 64), (torch.float16, None))
    graph_backends: tuple[str, ...] = ("flex", "gather")
    # (attention_backend, enforce_eager) of the engine's throughput runs; gather runs the first two batches
    throughput_configs: tuple = (("flex", False), ("gather", False))
    warm_steps: int = 3
    long_context: int = 131072  # max_model_len of the long_context check (Llama-3.1's)
    long_seqs: int = 64


LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_BIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=301, max_position_embeddings=256, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=301)
FULL = Sizes("cuda", torch.bfloat16, 16, LLAMA_8B, (1, 64, 256), 2048, 32, 2048)
# The dry run walks the same code with less of everything, in float32 (bf16 matmuls are slow on
# CPUs without bf16 units; the backend check keeps its 16-bit caches), since FlexAttention's CPU
# reference is traced afresh per shape, seconds each on a small machine.
DRY = Sizes("cpu", torch.float32, 4, TINY_BIG, (1, 4), 48, 2, 40, block_size=16, num_prompts=4,
            kernel_cases=((torch.float16, 8),), graph_backends=("auto",), warm_steps=1,
            throughput_configs=(("auto", False),), long_context=1024, long_seqs=8)


@dataclass
class Check:
    name: str
    status: str = "pass"  # pass | fail | error | skipped
    detail: dict = field(default_factory=dict)
    seconds: float = 0.0


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- tiny checkpoints -------------------------------------------------------------------------

def hf_config(arch: str, **overrides):
    import transformers

    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=301, max_position_embeddings=256, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None, pad_token_id=0, initializer_range=0.1)
    if arch == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=301, n_positions=256,
                                       bos_token_id=None, eos_token_id=None, pad_token_id=0, **overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    if arch == "qwen3":
        base.update(head_dim=32, sliding_window=None)
    base.update(overrides)
    return cls(**base)


def write_hf(directory: Path, arch: str, dtype: torch.dtype, seed: int = 0, **overrides) -> Path:
    """A random HF model of `arch` saved in `dtype` (norms and biases get noise too)."""
    import transformers

    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(directory)
    return directory


def write_llama(directory: Path, fields: dict, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> Path:
    """A random LlamaForCausalLM checkpoint (HF's names and config.json) written without
    `transformers`: tensors drawn on `device` (fast for 8B shapes on a GPU), saved as safetensors."""
    from safetensors.torch import save_file

    h, heads, kv = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
    d, inter, vocab = h // heads, fields["intermediate_size"], fields["vocab_size"]
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, generator=g, device=device)).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": norm()}
    for i in range(fields["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": normal(heads * d, h), p + "self_attn.k_proj.weight": normal(kv * d, h),
                    p + "self_attn.v_proj.weight": normal(kv * d, h), p + "self_attn.o_proj.weight": normal(h, heads * d),
                    p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
                    p + "mlp.down_proj.weight": normal(h, inter)}
    if not fields.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = normal(vocab, h)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": None,
              "eos_token_id": None, "pad_token_id": 0, "dtype": str(dtype).removeprefix("torch."), **fields}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def write_transformer(directory: Path, dtype: torch.dtype) -> Path:
    """The paper's Transformer, tiny, saved in our format."""
    from model.loading.checkpoint import save_model
    from model.models.registry import build_model

    net = build_model(ModelConfig(vocab_size=301, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=256))
    net.init_weights(0)
    save_model(net.to(dtype), directory)
    return directory


def prompts(n: int, vocab: int = 301, seed: int = 0, base: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (base + 7 * i,), generator=g).tolist() for i in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


# ---- 1. parity --------------------------------------------------------------------------------

def check_parity(s: Sizes, work: Path) -> Check:
    check = Check("parity")
    for arch in ("llama", "qwen3", "gpt2", "transformer"):
        if arch != "transformer" and not have_transformers():
            check.detail[arch] = {"ok": False, "equal": 0, "prompts": 0,
                                  "not_checked": "transformers is not installed"}
            check.status = "fail"
            continue
        directory = work / f"parity-{arch}"
        if arch == "transformer":
            write_transformer(directory, s.dtype)
        else:
            write_hf(directory, arch, s.dtype)
        ps = prompts(s.num_prompts)
        llm = LLM(str(directory), device=s.device, dtype=str(s.dtype).removeprefix("torch."))
        ours = [o.token_ids for o in llm.generate(ps, greedy(s.parity_tokens))]
        if arch == "transformer":  # no HF class: the dense, cache-free forward of the same weights
            refs, logits = dense_greedy(llm.engine.runner.model, ps, s.parity_tokens, s.device)
        else:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=s.dtype).to(s.device).eval()
            refs, logits = hf_greedy(hf, ps, s.parity_tokens, s.device)
            del hf
        rows = [compare_tokens(a, b, lg) for a, b, lg in zip(ours, refs, logits)]
        ok = all(r["equal"] or r["near_tie"] for r in rows)
        check.detail[arch] = {"ok": ok, "equal": sum(r["equal"] for r in rows), "prompts": len(rows), "rows": rows}
        if not ok:
            check.status = "fail"
        del llm
        free(s.device)
    return check


@torch.inference_mode()
def hf_greedy(hf, ps: list[list[int]], n: int, device: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    toks, logits = [], []
    for p in ps:
        ids = torch.tensor([p], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        toks.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.stack([x[0].float().cpu() for x in out.logits]))  # (n, vocab)
    return toks, logits


@torch.inference_mode()
def dense_greedy(net, ps: list[list[int]], n: int, device: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    toks, logits = [], []
    for p in ps:
        ids, steps = list(p), []
        for _ in range(n):
            row = net.forward_train(torch.tensor([ids], device=device))[0, -1].float().cpu()
            steps.append(row)
            ids.append(int(row.argmax()))
        toks.append(ids[len(p):])
        logits.append(torch.stack(steps))
    return toks, logits


def compare_tokens(ours: list[int], ref: list[int], ref_logits: torch.Tensor) -> dict:
    """Equal, or where they first differ, whether the reference's top two logits were a near-tie."""
    diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if diff is None:
        return {"equal": len(ours) == len(ref), "near_tie": False, "first_diff": None}
    top = ref_logits[diff].topk(2).values
    margin = float(top[0] - top[1])
    return {"equal": False, "first_diff": diff, "margin": round(margin, 5),
            "near_tie": margin <= TIE * max(1.0, abs(float(top[0])))}


# ---- 2. batch invariance ----------------------------------------------------------------------

def check_batch_invariance(s: Sizes, work: Path) -> Check:
    directory = write_llama(work / "invariance", TINY_LLAMA, torch.float32, seed=1)
    llm = LLM(str(directory), device=s.device, dtype="float32", engine_config=EngineConfig(max_num_seqs=32))
    needle, others = prompts(1, seed=9)[0], prompts(16, seed=10)
    alone = llm.generate([needle], greedy(s.parity_tokens))[0].token_ids
    batched = llm.generate(others[:8] + [needle] + others[8:], greedy(s.parity_tokens))[8].token_ids
    del llm
    free(s.device)
    return Check("batch_invariance", "pass" if alone == batched else "fail", {"alone": alone, "batched": batched})


# ---- 3. backends ------------------------------------------------------------------------------

def check_backends(s: Sizes, work: Path) -> Check:
    check = Check("backends")
    hq, hkv, d = (32, 8, 128) if s.device == "cuda" else (4, 2, 16)
    worst = {}
    for dtype, window in s.kernel_cases:
        worst[f"{str(dtype).removeprefix('torch.')}-window{window}"] = kernel_errors(s, dtype, window, hq, hkv, d)
    tol = 2e-2
    check.detail["max_abs_err"] = worst
    check.detail["tolerance"] = tol
    if max(max(e.values()) for e in worst.values()) > tol:
        check.status = "fail"
    directory = write_llama(work / "backends", TINY_LLAMA, torch.float32, seed=2)
    tokens = {}
    for backend in ("gather", "flex"):
        llm = LLM(str(directory), device=s.device, dtype="float32", attention_backend=backend,
                  engine_config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=64))
        tokens[backend] = [o.token_ids for o in llm.generate(prompts(s.num_prompts, seed=3), greedy(s.parity_tokens))]
        del llm
        free(s.device)
    check.detail["engine_tokens_equal"] = tokens["gather"] == tokens["flex"]
    if not check.detail["engine_tokens_equal"]:
        check.status = "fail"
    return check


@torch.inference_mode()
def kernel_errors(s: Sizes, dtype: torch.dtype, window: int | None, hq: int, hkv: int,
                  d: int) -> dict:
    """Flex decode and prefill against the engine's own gather path (PagedAttention with no kernels)
    over a scattered pool -> max abs errors. The prefill row owns physical block 0 and two of its
    contexts fill their blocks exactly, so a padded chunk (3 -> 4, 5 -> 8 queries) would list a
    block past its table if the padding counted as context."""
    bs, ctx = s.block_size, s.kernel_context
    lens = [1, bs, bs + 1, ctx // 3, ctx - 5, ctx]
    width = -(-ctx // bs)
    num_blocks = len(lens) * width + 7
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    row = tables[-1]
    if not bool((row == 0).any()):
        row[len(row) // 2] = 0
    tables = tables.to(s.device)
    cache = KVCache(1, num_blocks, bs, hkv, d, dtype, s.device)
    cache.keys[0].copy_(torch.randn(num_blocks, bs, hkv, d, generator=g))
    cache.values[0].copy_(torch.randn(num_blocks, bs, hkv, d, generator=g))
    attn = PagedAttention(0, d, DotScore(d), window=window)
    flex = FlexPagedAttention(num_blocks, bs, s.device)
    q = torch.randn(len(lens), hq, d, generator=g).to(s.device, dtype)
    context = torch.tensor(lens, device=s.device)
    flex.new_step()
    got = flex.decode(q, cache.keys[0], cache.values[0], tables, context, attn.scale, window)
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    meta = AttnMetadata(slot_mapping=torch.tensor(slots, device=s.device), num_decode=len(lens),
                        decode_block_tables=tables, decode_context_lens=context, decode_max_context=max(lens))
    errs = {"decode": _max_err(got, engine_gather(attn, q, meta, cache))}
    for length, context_len in ((3, ctx - 2), (5, (ctx // bs) * bs), (16, (ctx // bs) * bs)):
        qp = torch.randn(length, hq, d, generator=g).to(s.device, dtype)
        flex.new_step()
        got = flex.prefill(qp, cache.keys[0], cache.values[0], tables[-1], context_len, attn.scale, window)
        slots = [int(tables[-1, p // bs]) * bs + p % bs for p in range(context_len - length, context_len)]
        meta = AttnMetadata(slot_mapping=torch.tensor(slots, device=s.device), prefills=[
            PrefillChunk(0, length, context_len, tables[-1])])
        errs[f"prefill{length}-ctx{context_len}"] = _max_err(got, engine_gather(attn, qp, meta, cache))
    return errs


def engine_gather(attn: PagedAttention, q: torch.Tensor, meta: AttnMetadata, cache: KVCache) -> torch.Tensor:
    """The engine's gather path for `meta`'s queries (no kernels in the metadata): the step writes
    the K/V already in its slots, so the cache is unchanged."""
    flat_k, flat_v = (c.view(-1, *c.shape[2:]) for c in (cache.keys[0], cache.values[0]))
    return attn(q, flat_k[meta.slot_mapping], flat_v[meta.slot_mapping], meta, cache)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---- 4. graphs --------------------------------------------------------------------------------

def check_graphs(s: Sizes, work: Path) -> Check:
    check = Check("graphs")
    directory = write_llama(work / "graphs", TINY_LLAMA, s.dtype, seed=4)
    dtype = str(s.dtype).removeprefix("torch.")
    for backend in s.graph_backends:
        runs = {}
        for eager in (True, False):
            llm = LLM(str(directory), device=s.device, dtype=dtype, enforce_eager=eager, attention_backend=backend,
                      engine_config=EngineConfig(max_num_seqs=16))
            n = s.num_prompts + 2
            ps, params = prompts(n, seed=5), [greedy(4 + 2 * i) for i in range(n)]  # batches shrink n .. 1
            runs[eager] = [o.token_ids for o in llm.generate(ps, params)]
            graphs = llm.engine.runner.graphs
            if graphs is not None:
                check.detail[f"{backend}_static_steps"] = graphs.num_steps
                check.detail[f"{backend}_replays"] = graphs.num_replays
                check.detail[f"{backend}_captured_buckets"] = sorted(graphs._graphs)
                check.detail[f"{backend}_eager_reason"] = graphs.eager_reason
            del llm
            free(s.device)
        check.detail[f"{backend}_equal"] = runs[True] == runs[False]
        if runs[True] != runs[False] or (s.device == "cuda" and not check.detail.get(f"{backend}_replays")):
            check.status = "fail"
    return check


# ---- 5. sampling ------------------------------------------------------------------------------

def check_sampling(s: Sizes, work: Path) -> Check:
    directory = write_llama(work / "sampling", TINY_LLAMA, torch.float32, seed=6)
    llm = LLM(str(directory), device=s.device, dtype="float32", engine_config=EngineConfig(max_num_seqs=16))
    n = s.parity_tokens + 4
    params = [
        SamplingParams(max_tokens=n, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=n, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5,
                       repetition_penalty=1.3, logit_bias={7: -100.0}, ignore_eos=True),
        SamplingParams(max_tokens=n, temperature=0.7, top_p=0.5, seed=11, ignore_eos=True, min_tokens=2),
    ]
    ps = prompts(3, seed=12)
    outs = llm.generate(ps, params)
    alone = llm.generate([ps[2]], params[2])[0].token_ids
    detail = {"lengths": [len(o.token_ids) for o in outs], "biased_token_sampled": 7 in outs[1].token_ids,
              "logprobs_ok": all(lp is not None and lp.logprob <= 0.0 and len(lp.top) == 3 for lp in outs[0].logprobs),
              "seed_batch_invariant": alone == outs[2].token_ids}
    ok = (detail["lengths"] == [n] * 3 and not detail["biased_token_sampled"] and detail["logprobs_ok"]
          and detail["seed_batch_invariant"])
    del llm
    free(s.device)
    return Check("sampling", "pass" if ok else "fail", detail)


# ---- 6. prefix cache ----------------------------------------------------------------------------

def check_prefix_cache(s: Sizes, work: Path) -> Check:
    directory = write_llama(work / "prefix", TINY_LLAMA, torch.float32, seed=7)
    base = prompts(1, seed=13, base=3 * s.block_size + 2)[0]
    # The prompt again, then tails of 1, 3 and 5 tokens after its first two full blocks.
    ps = [base, base] + [base[: 2 * s.block_size] + [11 + i] * (1 + 2 * i) for i in range(3)]
    tokens, hits = {}, 0
    for caching in (True, False):
        llm = LLM(str(directory), device=s.device, dtype="float32",
                  engine_config=EngineConfig(max_num_seqs=8, enable_prefix_caching=caching))
        tokens[caching] = [llm.generate([p], greedy(s.parity_tokens))[0].token_ids for p in ps]
        if caching:
            hits = llm.engine.stats().prefix_cache_hits
        del llm
        free(s.device)
    detail = {"equal": tokens[True] == tokens[False], "cached_tokens": hits}
    ok = detail["equal"] and hits >= 4 * 2 * s.block_size
    return Check("prefix_cache", "pass" if ok else "fail", detail)


# ---- 7. speculative decoding ----------------------------------------------------------------------

def check_spec_decode(s: Sizes, work: Path) -> Check:
    directory = write_llama(work / "spec", TINY_LLAMA, torch.float32, seed=8)
    draft = write_llama(work / "spec-draft", TINY_LLAMA, torch.float32, seed=9)
    # repeats, so ngram finds matches; every prompt runs at once, so speculation must stay on past
    # the default disable_by_batch_size (3 for ngram): the first GPU run proposed nothing
    ps = [p[:9] * 3 for p in prompts(s.num_prompts, seed=14, base=9)]
    n = s.parity_tokens + 8
    configs = {"plain": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                         "disable_by_batch_size": 64},
               "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                               "disable_by_batch_size": 64}}
    tokens, detail = {}, {}
    for name, spec in configs.items():
        llm = LLM(str(directory), device=s.device, dtype="float32", speculative_config=spec,
                  engine_config=EngineConfig(max_num_seqs=8))
        tokens[name] = [o.token_ids for o in llm.generate(ps, greedy(n))]
        if spec is not None:
            stats = llm.engine.stats()
            detail[name] = {"equal": tokens[name] == tokens["plain"], "drafts": stats.spec_decode_num_draft_tokens,
                            "accepted": stats.spec_decode_num_accepted_tokens}
        del llm
        free(s.device)
    ok = all(d["equal"] and d["drafts"] > 0 for d in detail.values())
    return Check("spec_decode", "pass" if ok else "fail", detail)


# ---- 8. long context memory ------------------------------------------------------------------------

def check_long_context(s: Sizes, work: Path) -> Check:
    """Decode graphs under flex at a long max_model_len with many sequences: the gather workspace,
    max_num_seqs x the context's blocks, must not be reserved (flex decode never reads it)."""
    fields = dict(TINY_LLAMA, max_position_embeddings=s.long_context)
    directory = write_llama(work / "long", fields, torch.float32, seed=10)
    free(s.device)
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if s.device == "cuda" else 0
    cfg = EngineConfig(max_num_seqs=s.long_seqs, num_kv_blocks=512, max_model_len=s.long_context,
                       attention_backend="flex", enforce_eager=False)
    llm = LLM(str(directory), device=s.device, dtype="float32", engine_config=cfg)
    cache = llm.engine.runner.cache
    pool = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    llm.generate(prompts(4, seed=15), greedy(s.parity_tokens))
    old_reserve = s.long_seqs * -(-s.long_context // s.block_size) * cache.keys[0][0].numel() * 4 * 2
    detail = {"workspace_blocks": cache.workspace_blocks, "kv_pool_bytes": pool,
              "workspace_bytes_before_the_fix": old_reserve}
    ok = cache.workspace_blocks == 0
    if s.device == "cuda":
        weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
        extra = torch.cuda.max_memory_allocated() - before - pool - weights
        detail |= {"peak_beyond_weights_and_pool_bytes": extra,
                   "replays": llm.engine.runner.graphs.num_replays,
                   "eager_reason": llm.engine.runner.graphs.eager_reason}
        ok = ok and extra < 256 * 2**20 and detail["replays"] > 0
    del llm, cache
    free(s.device)
    return Check("long_context", "pass" if ok else "fail", detail)


# ---- 9. throughput ----------------------------------------------------------------------------

@dataclass
class Throughput:
    engine: str  # "qkv flex+graphs", "qkv gather+graphs", "hf generate"
    batch: int
    context: int
    step_ms: float
    tokens_per_s: float
    roofline_step_ms: float
    roofline_fraction: float
    bytes_per_step: float
    flops_per_step: float


def roofline(cfg: dict, n_params: int, batch: int, context: int) -> tuple[float, float, float]:
    """(bytes, flops, seconds) of one decode step: every weight but the input embedding's rows
    is read once, every sequence reads its K/V; 2 FLOPs per weight per token plus attention."""
    h, layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = h // heads
    read = n_params - cfg["vocab_size"] * h  # the embedding table is read a row per token
    kv_bytes = batch * context * 2 * layers * cfg["num_key_value_heads"] * d * 2
    weight_bytes = read * 2 + batch * h * 2
    flops = 2 * read * batch + 4 * batch * context * layers * heads * d
    seconds = max((weight_bytes + kv_bytes) / HBM_BYTES_PER_S, flops / PEAK_FLOPS)
    return weight_bytes + kv_bytes, flops, seconds


def check_throughput(s: Sizes, work: Path, deadline: float, profile_steps: int = 0,
                     hf_too: bool = True) -> tuple[Check, list[Throughput]]:
    check, rows = Check("throughput"), []
    t0 = time.perf_counter()
    directory = write_llama(work / "llama-8b-shaped", s.big, s.dtype, s.device)
    b, h, layers = s.big, s.big["hidden_size"], s.big["num_hidden_layers"]
    d = h // b["num_attention_heads"]
    n_params = (2 * b["vocab_size"] * h + h + layers * (2 * h + 2 * h * b["num_attention_heads"] * d
                + 2 * h * b["num_key_value_heads"] * d + 3 * h * b["intermediate_size"]))
    check.detail["write_s"] = round(time.perf_counter() - t0, 1)
    check.detail["params"] = n_params
    free(s.device)
    for backend, eager in s.throughput_configs:
        batches = s.batches if backend != "gather" else s.batches[:2]
        if time.perf_counter() > deadline:
            check.detail[f"skipped_{backend}"] = "time budget"
            check.status = "fail"
            continue
        profiles: dict = {}
        rows += engine_throughput(s, directory, n_params, backend, eager, batches, profile_steps, profiles)
        if profiles:
            check.detail.setdefault("profiles", {}).update(profiles)
    if not hf_too:
        check.detail["hf"] = "not asked for (--no-hf)"
    elif not have_transformers():
        check.detail["skipped_hf"] = "transformers is not installed"
        check.status = "fail"
    elif time.perf_counter() < deadline:
        import transformers

        hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=s.dtype).to(s.device).eval()
        for batch in s.batches:
            if time.perf_counter() > deadline:
                check.detail[f"skipped_hf_batch{batch}"] = "time budget"
                check.status = "fail"
                continue
            try:
                rows.append(hf_throughput(s, hf, n_params, batch))
            except torch.OutOfMemoryError:
                check.detail[f"hf_batch{batch}"] = "out of memory"
                free(s.device)
        del hf
        free(s.device)
    else:
        check.detail["skipped_hf"] = "time budget"
        check.status = "fail"
    return check, rows


@torch.inference_mode()
def engine_throughput(s: Sizes, directory: Path, n_params: int, backend: str, eager: bool,
                      batches: tuple[int, ...], profile_steps: int = 0,
                      profiles: dict | None = None) -> list[Throughput]:
    """Decode steps of `batch` sequences whose `context` positions are cached in distinct blocks
    (the cache holds zeros: the same bytes move), driven through the runner as the engine does."""
    warm = s.warm_steps
    per_seq = -(-(s.context + warm + s.steps + profile_steps + 1) // s.block_size)
    cfg = EngineConfig(max_num_seqs=max(batches), num_kv_blocks=max(batches) * per_seq, block_size=s.block_size,
                       max_model_len=per_seq * s.block_size, enable_prefix_caching=False,
                       attention_backend=backend, enforce_eager=eager)
    llm = LLM(str(directory), device=s.device, dtype=str(s.dtype).removeprefix("torch."), engine_config=cfg)
    runner, out = llm.engine.runner, []
    name = f"qkv {runner.backend}{'' if eager or s.device != 'cuda' else '+graphs'}"
    vocab = s.big["vocab_size"]
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        seqs = []
        for i in range(batch):
            seq = Sequence(f"t{i}", torch.randint(1, vocab, (s.context,), generator=g).tolist(), greedy(10**6))
            seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
            seq.num_computed_tokens = s.context - 1
            seqs.append(seq)
        rows = [SamplingRow(q.params, q.prompt_token_ids, q.output_token_ids, None, []) for q in seqs]

        def step(seqs: list[Sequence] = seqs, rows: list[SamplingRow] = rows) -> None:
            toks, _ = runner.run([ScheduledSeq(q, 1) for q in seqs], rows)
            for q, t in zip(seqs, toks):
                q.output_token_ids.append(t)
                q.num_computed_tokens += 1

        for i in range(warm + s.steps):
            if i == warm:
                sync(s.device)
                t0 = time.perf_counter()
            step()
        sync(s.device)
        step_s = (time.perf_counter() - t0) / s.steps
        out.append(_row(name, s, n_params, batch, step_s))
        logger.info("%s batch %d: %.2f ms/step", name, batch, step_s * 1e3)
        if profile_steps:
            profiles[f"{name} batch {batch}"] = profile_decode(s, step, profile_steps)
    del llm, runner
    free(s.device)
    return out


def profile_decode(s: Sizes, step, n: int) -> dict:
    """Where a decode step's time goes: wall time per step against the time the device ran
    kernels (a step far above its kernels' time waits on the host), and the kernels that took most."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            sync(s.device)
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            sync(s.device)
            wall = (time.perf_counter() - t0) / n
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / n
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
        cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda e: -e.self_cpu_time_total)[:8]
        result = {"steps": n, "wall_ms_per_step": round(wall * 1e3, 3),
                  "kernel_ms_per_step": round(busy / 1e3, 3), "kernels_per_step": round(len(kernels) / n, 1),
                  "top_kernels": [{"name": k[:90], "ms_per_step": round(sum(v) / n / 1e3, 3), "calls_per_step": len(v) / n}
                                  for k, v in top],
                  "top_cpu_ops": [{"name": e.key[:60], "self_ms_per_step": round(e.self_cpu_time_total / n / 1e3, 3)}
                                  for e in cpu]}
        logger.info("profile: wall %.2f ms/step, kernels %.2f ms/step", result["wall_ms_per_step"],
                    result["kernel_ms_per_step"])
        return result
    except Exception as exc:  # a profile is extra: its failure is recorded, the check's figures stay
        return {"error": f"{type(exc).__name__}: {exc}"}


def hf_throughput(s: Sizes, hf, n_params: int, batch: int) -> Throughput:
    """HF `generate` (greedy, its default dynamic cache, SDPA) at `batch` over `context`-token
    prompts; the decode steps are timed between calls of a logits processor."""
    import transformers

    stamps: list[float] = []

    def clock(input_ids, scores):
        sync(s.device)
        stamps.append(time.perf_counter())
        return scores

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, s.big["vocab_size"], (batch, s.context), generator=g).to(s.device)
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.steps + 1, min_new_tokens=s.steps + 1,
                    do_sample=False, pad_token_id=0,
                    logits_processor=transformers.LogitsProcessorList([clock]))
    step_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    free(s.device)
    logger.info("hf generate batch %d: %.2f ms/step", batch, step_s * 1e3)
    return _row("hf generate", s, n_params, batch, step_s)


def _row(name: str, s: Sizes, n_params: int, batch: int, step_s: float) -> Throughput:
    nbytes, flops, roof = roofline(s.big, n_params, batch, s.context)
    return Throughput(name, batch, s.context, round(step_s * 1e3, 3), round(batch / step_s, 1), round(roof * 1e3, 3),
                      round(roof / step_s, 3), nbytes, flops)


# ---- the run ----------------------------------------------------------------------------------

def environment(s: Sizes) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": s.device}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    if s.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = flash_attn.__version__
    except ImportError:
        env["flash_attn"] = None
    return env


def run_check(fn, *args) -> Check:
    t0 = time.perf_counter()
    try:
        check = fn(*args)
    except Exception as exc:
        check = Check(fn.__name__.removeprefix("check_"), "error",
                      {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)})
    check.seconds = round(time.perf_counter() - t0, 1)
    logger.info("%s: %s (%.1f s)", check.name, check.status, check.seconds)
    return check


CHECKS = (("parity", check_parity), ("batch_invariance", check_batch_invariance), ("backends", check_backends),
          ("graphs", check_graphs), ("sampling", check_sampling), ("prefix_cache", check_prefix_cache),
          ("spec_decode", check_spec_decode), ("long_context", check_long_context))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the whole sequence on the CPU with tiny shapes")
    ap.add_argument("--out", default="device_check.json", help="where the JSON goes")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="throughput parts that would start after this many seconds are skipped")
    ap.add_argument("--profile-steps", type=int, default=5,
                    help="decode steps profiled per throughput batch (kernel time against wall time); 0: none")
    ap.add_argument("--batches", default="", help="throughput batches, e.g. 1,64 (default: 1,64,256)")
    ap.add_argument("--backends", default="", help="throughput backends, e.g. flex (default: flex,gather)")
    ap.add_argument("--no-hf", action="store_true", help="no HF generate throughput")
    ap.add_argument("--result", default=None,
                    help="also write the docs' result file here (loadtests/tools/results.py's schema: "
                         "throughput table, checks and profile tables, the report under raw)")
    ap.add_argument("--from", dest="from_reports", nargs="+", default=None, metavar="REPORT",
                    help="write --result from saved reports instead of running: the first gives the throughput "
                         "and the checks, a check that failed there is taken from a later report that ran it, "
                         "and every report's profiles are listed")
    ap.add_argument("--note", default=None, help="the result file's note")
    ap.add_argument("--skip", default="", help="comma-separated checks to skip: "
                                                + ", ".join([name for name, _ in CHECKS] + ["throughput"]))
    args = ap.parse_args(argv)
    if args.from_reports:
        if not args.result:
            ap.error("--from needs --result")
        write_docs_result(args.result, [json.loads(Path(r).read_text()) for r in args.from_reports], args.note)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("model", "transformers", "torch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    s = DRY if args.dry_run else FULL
    if args.batches:
        s = replace(s, batches=tuple(int(b) for b in args.batches.split(",")))
    if args.backends:
        s = replace(s, throughput_configs=tuple(c for c in s.throughput_configs
                                                if c[0] in args.backends.split(",")))
    if s.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU sequence", file=sys.stderr)
        return 2
    start = time.perf_counter()
    command, commit = results.command_line(), results.git_commit()  # the device's copy may have no .git: "unknown"
    skip = set(filter(None, args.skip.split(",")))
    checks: list[Check] = []
    rows: list[Throughput] = []

    def report() -> dict:  # written after every check: a run cut off by a time limit keeps what it did
        out = {"dry_run": args.dry_run, "command": command, "commit": commit,
               "date": datetime.date.today().isoformat(), "environment": environment(s),
               "elapsed_s": round(time.perf_counter() - start, 1),
               "hbm_bytes_per_s": HBM_BYTES_PER_S, "peak_flops": PEAK_FLOPS,
               "checks": [asdict(c) for c in checks], "throughput": [asdict(r) for r in rows]}
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        return out

    with tempfile.TemporaryDirectory(prefix="qkv-device-check-") as tmp:
        work = Path(tmp)
        for name, fn in CHECKS:
            checks.append(Check(name, "skipped") if name in skip else run_check(fn, s, work))
            report()
        if "throughput" in skip:
            checks.append(Check("throughput", "skipped"))
        else:
            t0 = time.perf_counter()
            try:
                check, rows = check_throughput(s, work, start + args.budget_s, args.profile_steps, not args.no_hf)
            except Exception as exc:
                check = Check("throughput", "error", {"error": f"{type(exc).__name__}: {exc}",
                                                      "traceback": traceback.format_exc(limit=6)})
            check.seconds = round(time.perf_counter() - t0, 1)
            checks.append(check)
    final = report()
    print_table(final)
    if args.result:
        final["environment"]["machine"] = results.machine_facts(s.device)
        Path(args.out).write_text(json.dumps(final, indent=2) + "\n")
        write_docs_result(args.result, [final], args.note)
    return 0 if all(c.status in ("pass", "skipped") for c in checks) else 1


def check_summary(check: dict) -> str:
    detail = {k: v for k, v in check["detail"].items() if k not in ("traceback", "rows", "profiles")}
    if check["name"] == "parity":
        detail = {k: f"{v['equal']}/{v['prompts']} equal{'' if v['ok'] else ' FAIL'}" for k, v in detail.items()}
    return json.dumps(detail)


def write_docs_result(path: str, reports: list[dict], note: str | None) -> dict:
    """The docs' result file (docs/results/device_check.json) of saved reports: the first report's
    throughput and checks; a check it failed that a later report passed is shown from the later one
    with the row saying so; each report's decode-step profiles in a table of their own."""
    first = reports[0]
    env = first["environment"]
    checks, taken_from = {c["name"]: c for c in first["checks"]}, {}
    for i, later in enumerate(reports[1:], start=2):
        for c in later["checks"]:
            if c["status"] == "pass" and checks.get(c["name"], {}).get("status") not in ("pass", None):
                checks[c["name"]], taken_from[c["name"]] = c, i
    check_rows = [[name, c["status"], c["seconds"],
                   (f"report {taken_from[name]} (report 1: {first_status}); " if name in taken_from else "")
                   + check_summary(c)[:300]]
                  for name, c in checks.items()
                  for first_status in [next(x["status"] for x in first["checks"] if x["name"] == name)]]
    rows = [[r["engine"], r["batch"], r["context"], r["step_ms"], r["tokens_per_s"], r["roofline_step_ms"],
             round(100 * r["roofline_fraction"], 1)] for r in first["throughput"]]
    profile_rows = []
    for i, rep in enumerate(reports, start=1):
        for c in rep["checks"]:
            for name, prof in c["detail"].get("profiles", {}).items():
                if "error" in prof:
                    continue
                top = prof["top_kernels"][0] if prof["top_kernels"] else {"name": "", "ms_per_step": 0}
                profile_rows.append([i, name, prof["wall_ms_per_step"], prof["kernel_ms_per_step"],
                                     prof["kernels_per_step"], f"{top['name'][:60]} ({top['ms_per_step']} ms)"])
    machine = env.get("machine") or {"cpu_model": None, "cores": None, "copy_bandwidth_gb_s": None,
                                     "matmul_peak_gflops": None, "not_measured": "the report predates machine facts"}
    machine = {**machine, "gpu": env.get("gpu"), "torch": env.get("torch"), "cuda": env.get("cuda"),
               "transformers": env.get("transformers")}
    commands = [f"report {i}: {r.get('command', 'not recorded')}" for i, r in enumerate(reports, start=1)]
    doc = {"benchmark": "device_check", "title": "The GPU device check: decode throughput of a Llama-3.1-8B shape",
           "command": "; ".join(commands), "date": first.get("date", datetime.date.today().isoformat()),
           "commit": first.get("commit", "not recorded"), "machine": machine,
           "table": {"columns": ["engine", "batch", "context", "ms/step", "tokens/s", "roofline ms", "% of roofline"],
                     "rows": rows},
           "tables": {"checks": {"columns": ["check", "status", "s", "detail"], "rows": check_rows}}}
    if profile_rows:
        doc["tables"]["profile"] = {"columns": ["report", "engine and batch", "wall ms/step (profiled)",
                                                "kernel ms/step", "kernels/step", "largest kernel"],
                                    "rows": profile_rows}
    if note:
        doc["note"] = note
    doc["raw"] = reports
    missing = results.problems(doc)
    if missing:
        raise ValueError(f"device_check result: {'; '.join(missing)}")
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return doc


def print_table(report: dict) -> None:
    env = report["environment"]
    print(f"\ndevice check on {env.get('gpu', env['device'])} (torch {env['torch']}), {report['elapsed_s']} s")
    print(f"{'check':<18}{'status':<9}{'s':>7}  detail")
    for c in report["checks"]:
        print(f"{c['name']:<18}{c['status']:<9}{c['seconds']:>7}  {check_summary(c)[:160]}")
    if report["throughput"]:
        print(f"\n{'engine':<22}{'batch':>6}{'ctx':>6}{'ms/step':>10}{'tok/s':>11}{'roof ms':>9}{'of roof':>9}")
        for r in report["throughput"]:
            print(f"{r['engine']:<22}{r['batch']:>6}{r['context']:>6}{r['step_ms']:>10.2f}{r['tokens_per_s']:>11.0f}"
                  f"{r['roofline_step_ms']:>9.2f}{r['roofline_fraction']:>9.1%}")


if __name__ == "__main__":
    sys.exit(main())
