"""Held-out loss by position: how far into a sequence a byte-level model still predicts text.

The corpus's last 64 KiB (held out from training: the last standard-library modules' pydoc text)
cut into windows of `--window` bytes; each model's next-byte loss averaged over positions
0..255, 256..511, ... of the windows, in bits per byte (8 is a uniform guess). The default model
and its draft learned 256-byte windows: past them their sinusoidal positions were never trained.

    .venv/bin/python loadtests/benchmarks/position_loss.py [--models transformer-base-trained transformer-draft-trained]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import write_json  # noqa: E402
from model import LLM  # noqa: E402
from model.training.corpus import build, stdlib_modules  # noqa: E402

HELD_OUT_BYTES = 64 * 1024


@torch.inference_mode()
def losses_by_position(model: str, ids: torch.Tensor, window: int) -> torch.Tensor:
    """(windows, window) next-byte losses in nats."""
    net = LLM(model, dtype="float32").engine.runner.model
    batch = torch.stack([ids[s:s + window + 1] for s in range(0, len(ids) - window - 1, window)])
    out = []
    for chunk in batch.split(8):
        logits = net.forward_train(chunk[:, :-1])  # (B, window, vocab)
        out.append(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="none")
                   .view(chunk.shape[0], -1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["transformer-base-trained", "transformer-draft-trained"])
    ap.add_argument("--window", type=int, default=768)
    ap.add_argument("--span", type=int, default=256, help="positions per reported range")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text, _ = build(stdlib_modules()[-12:], None)
    ids = torch.frombuffer(bytearray(text.encode("utf-8")[-HELD_OUT_BYTES:]), dtype=torch.uint8).long()
    result = {}
    for model in args.models:
        loss = losses_by_position(model, ids, args.window)
        spans = {f"{a}-{a + args.span - 1}": loss[:, a:a + args.span].mean().item() / math.log(2)
                 for a in range(0, args.window, args.span)}
        result[model] = spans
        print(model, ", ".join(f"positions {k}: {v:.2f} bits/byte" for k, v in spans.items()), flush=True)
    if args.out:
        write_json(args.out, {"args": vars(args), "bits_per_byte": result})


if __name__ == "__main__":
    main()
