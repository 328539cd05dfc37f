"""Speculative decoding (issue 27): tokens/s, acceptance rate and mean accepted length for off /
ngram / draft model at batch 1, 4 and 32, on a workload whose output repeats its input and one
whose output does not. Prints a table and writes JSON.

    python loadtests/bench_spec_decode.py --model transformer-base-trained \\
        --draft model/weights/transformer-draft-trained --out spec_decode.json
    python loadtests/bench_spec_decode.py --backoff            # the back-off measurement
    python loadtests/bench_spec_decode.py --quick              # tiny models, a minute at most

`--backoff` times one verification forward (B sequences x (1 + k) positions, with the sampling
that verifies them) against one plain decode step (B x 1) at B = 1..32 over a 64-token context:
speculation pays while that ratio stays below the expected tokens per verification,
(1 - a^(k+1)) / (1 - a) at acceptance rate a. The smallest B where it does not at a = 0.5 is the
default `disable_by_batch_size` (model/engine/spec_decode/config.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig, ModelConfig  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.scheduler import ScheduledSeq  # noqa: E402

PASSAGES = [textwrap.dedent(m.__doc__ or "") for m in
            (__import__("json"), __import__("textwrap"), __import__("argparse"), __import__("heapq"),
             __import__("bisect"), __import__("shlex"), __import__("string"), __import__("pickle"))]


def workload(name: str, batch: int, nbytes: int) -> list[str]:
    """`repeat`: a passage, then its start again (a copy continues it: editing, refactoring);
    `fresh`: the start of a passage the prompt never showed more of."""
    out = []
    for i in range(batch):
        full = PASSAGES[i % len(PASSAGES)].strip()
        # later rounds start further in, wrapping inside the first half (some docstrings are one line)
        text = full[(i // len(PASSAGES)) * 40 % max(1, len(full) // 2):]
        if name == "repeat":
            body = text[:nbytes]
            out.append(f"Repeat this text.\n\n{body}\n\nRepeated:\n\n{body[:48]}")
        else:
            out.append(text[:64])
    return out


def run(model: str, spec: dict | None, prompts: list[str], max_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    llm = LLM(model, dtype="float32", engine_config=EngineConfig(max_num_seqs=max(64, len(prompts)),
                                                                 speculative_config=spec))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm-up " * 4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    st0 = llm.engine.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    st = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = st.spec_decode_num_draft_tokens - st0.spec_decode_num_draft_tokens
    accepted = st.spec_decode_num_accepted_tokens - st0.spec_decode_num_accepted_tokens
    verifies = (st.spec_decode_num_drafts_per_position[0] - st0.spec_decode_num_drafts_per_position[0]
                if st.spec_decode_num_drafts_per_position else 0)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifies if verifies else None,
            "outputs": [o.token_ids for o in outs]}


def bench(args) -> list[dict]:
    methods = {"off": None, "ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                                      "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}}
    if args.draft:
        methods["draft"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    rows = []
    for wl in ("repeat", "fresh"):
        for batch in args.batch:
            prompts = workload(wl, batch, args.prompt_bytes)
            base = None
            for name, spec in methods.items():
                r = run(args.model, spec, prompts, args.max_tokens, args.threads)
                if base is None:
                    base = r
                same = r["outputs"] == base["outputs"]  # greedy: speculation must not change a token
                row = {"workload": wl, "batch": batch, "method": name, "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                       "greedy_identical": same, **{k: v for k, v in r.items() if k != "outputs"}}
                rows.append(row)
                fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                print(f"{wl:7} {batch:5} {name:6} {r['tokens_per_s']:9.1f} tok/s  x{row['speedup']:.2f}  "
                      f"accept {fmt(r['acceptance_rate'])}  mean len {fmt(r['mean_accepted_length'])}  "
                      f"identical {same}", flush=True)
    return rows


@torch.inference_mode()
def backoff(args) -> list[dict]:
    """Verification step / decode step time ratio at batch sizes 1..32 (see the module doc)."""
    torch.set_num_threads(args.threads)
    k, rows = args.k, []
    for b in (1, 2, 4, 8, 12, 16, 24, 32):
        eng = Engine(args.model, EngineConfig(max_num_seqs=64, speculative_config={"method": "ngram",
                                                                                  "num_speculative_tokens": k}),
                     dtype="float32")
        rng = random.Random(b)
        for i in range(b):
            eng.add_request(str(i), [rng.randrange(eng.model_config.vocab_size) for _ in range(64)],
                            SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        while any(s.num_uncomputed_tokens != 1 for s in eng.scheduler.running) or len(eng.scheduler.running) < b:
            eng.step()
        seqs = list(eng.scheduler.running)
        for s in seqs:
            eng.scheduler.blocks.grow(s, s.num_computed_tokens + 1 + k)
        decode = [ScheduledSeq(s, 1) for s in seqs]
        verify = [ScheduledSeq(s, 1 + k, [rng.randrange(eng.model_config.vocab_size) for _ in range(k)]) for s in seqs]

        def t_decode() -> None:
            eng.runner.run(decode, [eng._row(s) for s in seqs])

        def t_verify() -> None:
            logits: dict = {}
            eng.runner.run(verify, [], None, logits)
            eng.spec.verify([(v.seq, v.spec, logits[v.seq.request_id], None) for v in verify], eng._row)

        times = {}
        for name, fn in (("decode", t_decode), ("verify", t_verify)):
            fn()
            samples = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
            times[name] = min(samples)  # the least disturbed run: the CPU is shared
        ratio = times["verify"] / times["decode"]
        rows.append({"batch": b, "k": k, "decode_ms": times["decode"] * 1e3, "verify_ms": times["verify"] * 1e3,
                     "ratio": ratio})
        print(f"batch {b:3}: decode {times['decode'] * 1e3:7.2f} ms, verify (1+{k}) {times['verify'] * 1e3:7.2f} ms, "
              f"ratio {ratio:.2f}", flush=True)
    for a in (0.3, 0.5, 0.7, 0.9):
        gain = (1 - a ** (k + 1)) / (1 - a)
        worth = [r["batch"] for r in rows if r["ratio"] < gain]
        print(f"acceptance {a}: {gain:.2f} tokens per verification; pays up to batch {max(worth, default=0)}")
    return rows


def tiny_models(root: Path) -> tuple[str, str]:
    """A tiny paper Transformer (byte vocabulary) and a noisy copy of it as the draft."""
    from model.loading.checkpoint import save_model
    from model.models.registry import build_model

    cfg = ModelConfig(vocab_size=258, d_model=64, n_heads=4, n_layers=2, d_ff=128, max_position=512)
    target = build_model(cfg)
    target.init_weights(3)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_model(target, root / "target")
    with torch.no_grad():
        for p in target.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_model(target, root / "draft")
    return str(root / "target"), str(root / "draft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="transformer-base-trained")
    ap.add_argument("--draft", default=None, help="draft checkpoint (same vocabulary); none: no draft rows")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=[3, 12], metavar=("MIN", "MAX"),
                    help="ngram prompt_lookup_min/max (in tokens: bytes for the byte-level default model)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-bytes", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7, help="--backoff: timed repeats per point")
    ap.add_argument("--backoff", action="store_true", help="measure the back-off rule instead")
    ap.add_argument("--quick", action="store_true", help="tiny models and sizes: checks the script runs")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.model, args.draft = tiny_models(Path(tmp))
            args.batch, args.max_tokens, args.prompt_bytes, args.repeats = [1, 4], 24, 120, 3
        result = {"args": {k: v for k, v in vars(args).items()}}
        result["backoff" if args.backoff else "rows"] = backoff(args) if args.backoff else bench(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
