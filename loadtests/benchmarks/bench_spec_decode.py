"""Speculative decoding (issue 27): tokens/s, acceptance rate and mean accepted length for off /
ngram / draft model at batch 1, 4 and 32, on a workload whose prompt asks for a copy of itself and
one that does not. Prints a table and writes JSON.

    python loadtests/benchmarks/bench_spec_decode.py --out docs/results/bench_spec_decode.json  # + its draft
    python loadtests/benchmarks/bench_spec_decode.py --backoff                # where speculation stops paying
    python loadtests/benchmarks/bench_spec_decode.py --quick                  # tiny models, a minute at most

Greedy, `ignore_eos`, 128 tokens per prompt. Batch B runs max(2B, --prompts) prompts in groups of
B (batch 1: one prompt after another). Every method has its engine built once; each round runs
off, ngram and draft in turn (reversed every other round), and the speed-up is the median over
rounds of each round's ratio to its plain run (drift on the shared machine hits both sides of a
ratio alike). `copied`: how many output tokens reproduce the asked-for copy before the first miss.

`--verify-cost` times the runner's verification of 1 + k positions against one decode step (batch 1,
100-token context); with `--no-small-batch-product` every product goes through `F.linear`, as it
did before `model/layers/linear/dense.py`.

`--backoff` runs the fresh workload at B = 1..16 with speculation never turned off, against plain
decoding: the largest B where a method still pays is its default `disable_by_batch_size`
(model/config/speculative.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig, ModelConfig  # noqa: E402
from model.engine.builder import build_engine  # noqa: E402
from model.engine.scheduler import ScheduledSeq  # noqa: E402
from model.layers.linear import dense  # noqa: E402
from model.training.corpus import build, stdlib_modules  # noqa: E402
from loadtests.lib.engine_steps import fill  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

# The default model (and the draft trained for it) learned 256-byte windows and held out the corpus's
# tail: its last modules' pydoc text is what the workloads are cut from, and every prompt plus its
# output stays inside 256 bytes (past that the default model's text falls apart: its sinusoidal
# positions never saw more).
HELD_OUT_MODULES = 12
FRESH_BYTES, REPEAT_BYTES, CUE_BYTES = 64, 80, 8


def passages(count: int) -> list[list[int]]:
    """`count` passages of held-out pydoc text (byte ids), each from a line start, spread evenly."""
    text, _ = build(stdlib_modules()[-HELD_OUT_MODULES:], None)
    data = text.encode("utf-8")
    out = []
    for i in range(count):
        at = i * (len(data) // count)
        while data[at:at + 1] in (b"\n", b" ", b"|"):  # past blank lines and pydoc's bare margins
            at += 1
        at = data.rfind(b"\n", 0, at) + 1
        out.append(list(data[at:at + REPEAT_BYTES]))
    return out


def workload(name: str, texts: list[list[int]]) -> tuple[list[list[int]], list[list[int]] | None]:
    """Prompts, and for `repeat` the copy each prompt asks for. `repeat`: a passage, a blank line
    and its first bytes again (a copy continues it: editing, refactoring); `fresh`: the start of
    a passage the prompt shows nothing more of."""
    if name == "fresh":
        return [t[:FRESH_BYTES] for t in texts], None
    sep = list(b"\n\n")
    return [t + sep + t[:CUE_BYTES] for t in texts], [t[CUE_BYTES:] for t in texts]


def copied(outputs: list[list[int]], copies: list[list[int]] | None) -> float | None:
    """Mean number of output tokens that reproduce the asked-for copy before the first miss."""
    if copies is None:
        return None
    lengths = []
    for out, want in zip(outputs, copies):
        n = 0
        while n < min(len(out), len(want)) and out[n] == want[n]:
            n += 1
        lengths.append(n)
    return sum(lengths) / len(lengths)


def timed(llm: LLM, groups: list[list[list[int]]], params: SamplingParams) -> dict:
    """Each group of prompts generated together, one group after another: tokens/s and the
    speculation counters over all of them."""
    st0 = llm.engine.stats()
    t0 = time.perf_counter()
    outs = [o.token_ids for g in groups for o in llm.generate(g, params)]
    wall = time.perf_counter() - t0
    st = llm.engine.stats()
    tokens = sum(len(o) for o in outs)
    drafts = st.spec_decode_num_draft_tokens - st0.spec_decode_num_draft_tokens
    accepted = st.spec_decode_num_accepted_tokens - st0.spec_decode_num_accepted_tokens
    verifies = (st.spec_decode_num_drafts_per_position[0] - st0.spec_decode_num_drafts_per_position[0]
                if st.spec_decode_num_drafts_per_position else 0)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "acceptance_rate": accepted / drafts if drafts else None,
            "mean_accepted_length": 1 + accepted / verifies if verifies else None, "outputs": outs}


def engines(args) -> dict[str, LLM]:
    """off, ngram and (with --draft) draft: one engine each, built once, warmed up."""
    methods: dict[str, dict | None] = {"off": None, "ngram": {
        "method": "ngram", "num_speculative_tokens": args.k_ngram, "prompt_lookup_min": args.lookup[0],
        "prompt_lookup_max": args.lookup[1], "disable_by_batch_size": args.disable_by_batch_size}}
    if args.draft:
        methods["draft"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k_draft,
                            "disable_by_batch_size": args.disable_by_batch_size}
    out = {}
    for name, spec in methods.items():
        llm = LLM(args.model, dtype="float32",
                  engine_config=EngineConfig(max_num_seqs=max(64, *args.batch), speculative_config=spec))
        llm.generate([list(b"warm-up " * 4)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        out[name] = llm
    return out


def rounds(llms: dict[str, LLM], run, count: int) -> dict[str, list[dict]]:
    """`run(llm)` for every engine in turn, `count` rounds, the order reversed every other round
    (a method that always ran first, or last, would carry any drift within a round)."""
    out: dict[str, list[dict]] = {name: [] for name in llms}
    for r in range(count):
        for name in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            out[name].append(run(llms[name]))
    return out


def bench(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    llms = engines(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"{'workload':8} {'batch':>5} {'method':6} {'tok/s':>8} {'speed-up':>8} {'rounds':>9} {'accept':>6} {'mean len':>8} "
          f"{'copied':>6} identical", flush=True)
    for wl in ("repeat", "fresh"):
        for batch in args.batch:
            n = max(2 * batch, args.prompts)  # two groups at least: a run of one short group is all noise
            prompts, copies = workload(wl, passages(n))
            groups = [prompts[i:i + batch] for i in range(0, n, batch)]
            runs = rounds(llms, lambda llm: timed(llm, groups, params), args.rounds)
            for name, rs in runs.items():
                r = dict(rs[0], tokens_per_s=statistics.median(x["tokens_per_s"] for x in rs))
                # each round's ratio to the plain run of the same round, then the median: drift
                # between rounds (the machine is shared) cancels
                ratios = [x["tokens_per_s"] / o["tokens_per_s"] for x, o in zip(rs, runs["off"])]
                same = all(x["outputs"] == runs["off"][0]["outputs"] for x in rs)  # greedy: not one token differs
                row = {"workload": wl, "batch": batch, "method": name, "prompts": n, "rounds": args.rounds,
                       "speedup": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
                       "greedy_identical": same,
                       "copied_tokens": copied(r["outputs"], copies),
                       **{k: v for k, v in r.items() if k != "outputs"}}
                rows.append(row)
                spread = f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}"
                print(f"{wl:8} {batch:5} {name:6} {r['tokens_per_s']:8.1f} {row['speedup']:7.2f}x {spread:>9} "
                      f"{fmt(r['acceptance_rate']):>6} {fmt(r['mean_accepted_length']):>8} "
                      f"{fmt(row['copied_tokens']):>6} {same}", flush=True)
    return rows


def backoff(args) -> list[dict]:
    """Speculation left on at every batch size (disable_by_batch_size above the largest) against
    plain decoding, on the fresh workload at B = --backoff-batch sizes: the speed-up per method and
    batch size. Speculation pays while it stays above 1; the largest B where a method still pays
    is its default `disable_by_batch_size` (model/config/speculative.py)."""
    args.disable_by_batch_size = max(args.backoff_batch)
    torch.set_num_threads(args.threads)
    llms = engines(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in args.backoff_batch:
        prompts, _ = workload("fresh", passages(batch))
        runs = rounds(llms, lambda llm: timed(llm, [prompts], params), args.rounds)
        line = []
        for name, rs in runs.items():
            if name == "off":
                continue
            speedup = statistics.median(x["tokens_per_s"] / o["tokens_per_s"] for x, o in zip(rs, runs["off"]))
            rows.append({"batch": batch, "method": name, "speedup": speedup, "acceptance_rate": rs[0]["acceptance_rate"],
                         "mean_accepted_length": rs[0]["mean_accepted_length"]})
            line.append(f"{name} x{speedup:.2f} (accept {rs[0]['acceptance_rate'] or 0:.2f})")
        print(f"batch {batch:3}: " + ", ".join(line), flush=True)
    for name in llms:
        pays = [r["batch"] for r in rows if r["method"] == name and r["speedup"] > 1.0]
        if name != "off":
            print(f"{name}: faster than plain decoding at batch sizes {pays}")
    return rows


@torch.inference_mode()
def verify_cost(args) -> list[dict]:
    """One sequence over a 100-token context: the runner's step verifying 1 + k positions (its
    forward and the sampling that checks the proposals) against a plain decode step, k = 1..8,
    in turn, median of --rounds x 5 timings each."""
    torch.set_num_threads(args.threads)
    eng = build_engine(args.model, EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 8}),
                 dtype="float32")
    vocab = eng.model_config.vocab_size
    fill(eng, 1, 100, 60, vocab)
    seq = eng.scheduler.running[0]
    eng.scheduler.blocks.grow(seq, seq.num_computed_tokens + 9)

    def verify(k: int) -> None:
        step = [ScheduledSeq(seq, 1 + k, [(i * 13) % vocab for i in range(k)])]
        logits: dict = {}
        eng.runner.run(step, [], None, logits)
        eng.spec.verify([(s.seq, s.spec, logits[s.seq.request_id], None) for s in step], eng._row)

    fns = {0: lambda: eng.runner.run([ScheduledSeq(seq, 1)], [eng._row(seq)])}
    fns.update({k: (lambda k=k: verify(k)) for k in range(1, 9)})
    samples: dict[int, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds * 5 + 2):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r >= 2:
                samples[k].append(time.perf_counter() - t0)
    decode = statistics.median(samples[0])
    rows = [{"k": k, "ms": statistics.median(v) * 1e3, "ratio": statistics.median(v) / decode}
            for k, v in samples.items()]
    print(f"decode step {decode * 1e3:.2f} ms; verification of 1 + k positions / decode step: "
          + ", ".join(f"k={r['k']} {r['ratio']:.2f}" for r in rows if r["k"]), flush=True)
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
    ap.add_argument("--draft", default="transformer-draft-trained",
                    help="draft preset or checkpoint (same vocabulary); '' for no draft rows")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--k-ngram", type=int, default=3, help="ngram num_speculative_tokens")
    ap.add_argument("--k-draft", type=int, default=3, help="draft num_speculative_tokens")
    ap.add_argument("--lookup", type=int, nargs=2, default=[1, 12], metavar=("MIN", "MAX"),
                    help="ngram prompt_lookup_min/max (in tokens: bytes for the byte-level default model)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None, help="default: the engine's")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8,
                    help="prompts per point at least: batch 1 runs this many one after another")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per point, methods in turn (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backoff-batch", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--backoff", action="store_true", help="measure the back-off rule instead")
    ap.add_argument("--verify-cost", action="store_true",
                    help="time one verification of 1 + k positions against a decode step instead")
    ap.add_argument("--no-small-batch-product", action="store_true",
                    help="every row count through F.linear (model/layers/linear/dense.py off): the figures before it")
    ap.add_argument("--quick", action="store_true", help="tiny models and sizes: checks the script runs")
    add_result_args(ap, None)
    args = ap.parse_args()
    if args.no_small_batch_product:
        dense.SMALL_ROWS_MAX = 1
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.model, args.draft = tiny_models(Path(tmp))
            args.batch, args.max_tokens, args.prompts, args.rounds, args.backoff_batch = [1, 4], 24, 4, 1, [1, 4]
        result = {"args": {k: v for k, v in vars(args).items()}}
        mode = "backoff" if args.backoff else "verify_cost" if args.verify_cost else "rows"
        result[mode] = {"backoff": backoff, "verify_cost": verify_cost, "rows": bench}[mode](args)
    columns, rows = table(mode, result[mode])
    print_table(columns, rows)
    if args.out:
        titles = {"rows": "Speculative decoding: off, ngram and draft model", "backoff": "Speculative decoding's "
                  "speed-up by batch size (the back-off rule)", "verify_cost": "Verifying 1 + k positions"}
        write_result(args.out, f"bench_spec_decode_{mode}" if mode != "rows" else "bench_spec_decode", columns, rows,
                     raw=result, note=args.note, title=titles[mode])


def table(mode: str, rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The result table of each mode, as the docs show it."""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    if mode == "verify_cost":
        return ["k", "step ms", "/ decode step"], [[str(r["k"]), f"{r['ms']:.2f}", f"{r['ratio']:.2f}"] for r in rows]
    if mode == "backoff":
        return ["batch", "method", "speed-up", "acceptance"], [
            [str(r["batch"]), r["method"], f"{r['speedup']:.2f}x", fmt(r["acceptance_rate"])] for r in rows]
    return (["workload", "batch", "method", "tok/s", "speed-up", "rounds' range", "acceptance", "mean accepted",
             "copied", "identical"],
            [[r["workload"], str(r["batch"]), r["method"], f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
              f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}", fmt(r["acceptance_rate"]),
              fmt(r["mean_accepted_length"]), fmt(r["copied_tokens"]), "yes" if r["greedy_identical"] else "no"]
             for r in rows])


if __name__ == "__main__":
    main()
