"""What `kv_cache_dtype` costs in accuracy and gains in speed, against a float32 cache, in one run.

Accuracy (GPT-2-small-shaped random weights, float32 model): sequences are prefilled, then
decoded teacher-forced on the float32 cache's greedy tokens, so every step compares like with
like: greedy agreement is the share of steps whose argmax equals the float32 cache's, and the
max logit difference is over all of them. Free-running greedy generation is compared too
(share of generated tokens before the first divergence).
Speed: decode steps of 64 sequences at ~270 tokens of context, and of 1, through the fused kernel.

    .venv/bin/python loadtests/benchmarks/bench_kv_cache_dtype.py [--sequences 16] [--steps 48]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk  # noqa: E402
from model.layers.paged_attention import paged_decode_attention, use_fused  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.loading.loading import build_preset  # noqa: E402
from loadtests.lib.step_profile import profile_decode  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


@torch.inference_mode()
def teacher_forced(model, prompts: list[list[int]], steps: int, kv_dtype: torch.dtype,
                   forced: torch.Tensor | None = None, block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill every prompt but its last token, then decode `steps` tokens for all B at once,
    feeding `forced` (B, steps) or, when None, each step's own argmax.
    Returns logits (steps, B, vocab) and the tokens fed after the prompt (B, steps)."""
    cfg = model.cfg
    b = len(prompts)
    per_seq = -(-(max(map(len, prompts)) + steps) // block_size)
    cache = KVCache(cfg.n_layers, b * per_seq, block_size, cfg.n_heads, cfg.d_head, kv_dtype, "cpu")
    tables = torch.arange(b * per_seq).view(b, per_seq)
    for i, p in enumerate(prompts):
        pos = torch.arange(len(p) - 1)
        meta = AttnMetadata(slot_mapping=tables[i][pos // block_size] * block_size + pos % block_size,
                            prefills=[PrefillChunk(0, len(pos), len(pos), tables[i])])
        model(torch.tensor(p[:-1]), pos, meta, cache)
    kernel = paged_decode_attention if use_fused(torch.device("cpu")) else None
    start = torch.tensor([len(p) - 1 for p in prompts])  # position of each prompt's last token
    tok = torch.tensor([p[-1] for p in prompts])
    logits, fed = [], []
    rows = torch.arange(b)
    for s in range(steps):
        pos = start + s
        meta = AttnMetadata(slot_mapping=tables[rows, pos // block_size] * block_size + pos % block_size,
                            num_decode=b, decode_block_tables=tables, decode_context_lens=pos + 1,
                            decode_max_context=int(pos.max()) + 1)
        meta.decode_kernel = kernel
        out = model.compute_logits(model(tok, pos, meta, cache)).float()  # (B, vocab)
        logits.append(out)
        tok = out.argmax(-1) if forced is None else forced[:, s]
        fed.append(tok)
    return torch.stack(logits), torch.stack(fed, dim=1)


def free_running(path: str, kv: str, prompts: list[list[int]], steps: int) -> list[list[int]]:
    llm = LLM(path, dtype="float32", engine_config=EngineConfig(kv_cache_memory_bytes=1 << 30, kv_cache_dtype=kv))
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def agreement(a: list[list[int]], ref: list[list[int]]) -> float:
    """Share of tokens generated before the first divergence from the reference."""
    same = sum(next((i for i, (x, y) in enumerate(zip(s, r)) if x != y), len(r)) for s, r in zip(a, ref))
    return same / sum(map(len, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-small-random")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--context", type=int, default=270)
    add_result_args(ap, "results/bench_kv_cache_dtype.json")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    model = build_preset(args.preset).eval()
    vocab = model.cfg.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(32, 200))] for _ in range(args.sequences)]
    ref_logits, ref_tokens = teacher_forced(model, prompts, args.steps, torch.float32)
    tmp = tempfile.mkdtemp(prefix="qkv-kvdtype-")
    save_model(model, tmp)
    ref_free = free_running(tmp, "float32", prompts, args.steps)
    res: dict = {"preset": args.preset, "sequences": args.sequences, "steps": args.steps, "dtypes": {}}
    for name in DTYPES:
        logits, _ = teacher_forced(model, prompts, args.steps, getattr(torch, name), forced=ref_tokens)
        r = {"greedy_agreement_teacher_forced": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
             "max_logit_diff": (logits - ref_logits).abs().max().item(),
             "greedy_agreement_free_running": agreement(free_running(tmp, name, prompts, args.steps), ref_free)}
        res["dtypes"][name] = r
    # Speed: one engine per dtype, measured in alternating rounds (best of 2) on this shared machine.
    engines = {name: LLM(tmp, dtype="float32", engine_config=EngineConfig(
        max_num_seqs=64, kv_cache_memory_bytes=(3 << 29) // (4 // getattr(torch, name).itemsize), kv_cache_dtype=name)).engine
        for name in DTYPES}
    for _ in range(2):
        for name, engine in engines.items():
            for b in (1, 64):
                ms = profile_decode(engine, b, args.context, steps=6)["step_ms"]
                key = f"decode_b{b}_step_ms"
                res["dtypes"][name][key] = min(ms, res["dtypes"][name].get(key, ms))
    res["logit_scale"] = ref_logits.abs().max().item()
    res["load_average_start_end"] = [load, os.getloadavg()[0]]
    base = res["dtypes"]["float32"]
    print(f"\n{args.preset}, float32 weights, {args.sequences} sequences x {args.steps} decode steps; "
          f"largest |logit| {res['logit_scale']:.1f}")
    columns = ["kv_cache_dtype", "greedy agreement (teacher-forced)", "free-running agreement", "max logit diff",
               "batch-64 step ms", "ratio", "batch-1 step ms", "ratio"]
    rows = [[name, f"{100 * r['greedy_agreement_teacher_forced']:.1f}%",
             f"{100 * r['greedy_agreement_free_running']:.1f}%", f"{r['max_logit_diff']:.2e}",
             f"{r['decode_b64_step_ms']:.1f}", f"{base['decode_b64_step_ms'] / r['decode_b64_step_ms']:.2f}x",
             f"{r['decode_b1_step_ms']:.1f}",
             f"{base['decode_b1_step_ms'] / r['decode_b1_step_ms']:.2f}x"] for name, r in res["dtypes"].items()]
    print_table(columns, rows)
    print(f"1-minute load average at start/end: {load:.2f} / {os.getloadavg()[0]:.2f} (2 cores)")
    if args.out:
        write_result(args.out, "bench_kv_cache_dtype", columns, rows, raw=res, note=args.note,
                     title=f"16-bit KV caches: {args.preset}, float32 weights")

if __name__ == "__main__":
    main()
