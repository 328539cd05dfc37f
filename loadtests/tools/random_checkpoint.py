"""Write a random Llama-family checkpoint of a real model's shape (loadtests/lib/checkpoints.py:
HF-compatible `config.json` + safetensors shards, without `transformers`), for benchmarks and
memory measurements.

    .venv/bin/python loadtests/tools/random_checkpoint.py /tmp/qwen-shape [--shape qwen2.5-0.5b-shape] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import SHAPES, write_random_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    ap.add_argument("--shape", default="qwen2.5-0.5b-shape", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_random_checkpoint(args.directory, args.shape, getattr(torch, args.dtype), args.seed)
    print(f"wrote {args.directory}")


if __name__ == "__main__":
    main()
