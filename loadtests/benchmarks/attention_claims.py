"""The paper's two claims about attention, measured by training (same data, seed and token budget).

1. Scaling: "for large values of d_k, the dot products grow large in magnitude, pushing the
   softmax function into regions where it has extremely small gradients" -- so scaled
   dot-product attention should learn faster than the same model without 1/sqrt(d_k) at d_k = 64.
2. Additive vs dot: "While for small values of d_k the two mechanisms perform similarly,
   additive attention outperforms dot product attention without scaling for larger values of
   d_k", and dot-product attention "is much faster ... in practice".

Each run trains a small decoder (the paper's layer: post-LayerNorm, ReLU FFN, sinusoidal
positions) from the same initial seed on the same corpus windows, and records validation loss
against steps and wall time per step. Prints a table, writes JSON and a plot.

    python loadtests/benchmarks/attention_claims.py --corpus corpus.txt --out results/claims
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import write_json  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from model.training.train import TrainConfig, train  # noqa: E402

# name -> (attention kind, scale scores by 1/sqrt(d_k), number of heads); d_model is fixed.
RUNS = {
    "dot, scaled, d_k=64": ("dot", True, 4),
    "dot, unscaled, d_k=64": ("dot", False, 4),
    "additive, d_k=64": ("additive", True, 4),
    "dot, scaled, d_k=8": ("dot", True, 32),
    "dot, unscaled, d_k=8": ("dot", False, 32),
    "additive, d_k=8": ("additive", True, 32),
}


def run_config(kind: str, scaled: bool, heads: int, d_model: int, layers: int) -> ModelConfig:
    return ModelConfig(d_model=d_model, n_heads=heads, n_layers=layers, d_ff=4 * d_model, max_position=512,
                       attention=kind, scale_scores=scaled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", default="results/claims")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--runs", nargs="*", default=list(RUNS), help="subset of: " + "; ".join(RUNS))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = Path(args.corpus).read_bytes()
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=1e-3,
                      warmup_steps=max(1, args.steps // 20), eval_every=args.eval_every, eval_batches=8)
    results = {}
    for name in args.runs:
        kind, scaled, heads = RUNS[name]
        start = time.perf_counter()
        _net, history = train(run_config(kind, scaled, heads, args.d_model, args.layers), text, cfg, progress=False)
        wall = time.perf_counter() - start
        results[name] = {"history": history, "wall_s": wall, "ms_per_step": 1000 * history[-1]["elapsed_s"] / args.steps,
                         "final_val_bits_per_byte": history[-1]["val_bits_per_byte"], "d_k": args.d_model // heads,
                         "attention": kind, "scaled": scaled}
        print(f"{name:24s} val {history[-1]['val_bits_per_byte']:.3f} bits/byte, "
              f"{results[name]['ms_per_step']:.0f} ms/step", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"train_config": cfg.__dict__ | {"betas": list(cfg.betas)}, "d_model": args.d_model, "layers": args.layers,
            "corpus_bytes": len(text), "tokens_per_run": args.steps * args.batch_size * args.seq_len}
    write_json(out / "claims.json", {"meta": meta, "runs": results})
    print_table(results)
    plot(results, out / "claims.png")


def print_table(results: dict) -> None:
    print("\n| run | d_k | final val bits/byte | ms / step |")
    print("|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['d_k']} | {r['final_val_bits_per_byte']:.3f} | {r['ms_per_step']:.0f} |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, d_k in zip(axes, sorted({r["d_k"] for r in results.values()}, reverse=True)):
        for name, r in results.items():
            if r["d_k"] == d_k:
                steps = [h["step"] for h in r["history"]]
                ax.plot(steps, [h["val_loss"] / math.log(2) for h in r["history"]], label=name)
        ax.set_title(f"d_k = {d_k}")
        ax.set_xlabel("training step")
        ax.legend()
    axes[0].set_ylabel("validation bits per byte")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
