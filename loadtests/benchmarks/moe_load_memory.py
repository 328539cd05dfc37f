"""Peak memory while loading a mixture-of-experts checkpoint: a random Qwen3-MoE-shaped model
(1.18B parameters: 16 layers, 64 experts of 256, top-8) built and saved in bf16 with
`transformers` (its per-expert tensors, as published MoE checkpoints store them), loaded by
our loader in a fresh process, which stacks each layer's experts into (E, ...) parameters.

The checkpoint is written once (to --dir, if it holds no config.json yet). Reports the
process's peak resident set against its resident set just before the load, next to the
checkpoint's size and one copy of the model at the target dtype (the lower bound), with
`bench_load_memory.py`'s measurement (loadtests/lib/load_memory.py).

    .venv/bin/python loadtests/benchmarks/moe_load_memory.py [--dir /tmp/qkv-qwen3-moe-1b-bf16] [--dtype bfloat16]
    .venv/bin/python loadtests/benchmarks/moe_load_memory.py --shape tiny-moe-shape --dir /tmp/qkv-moe-tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import MOE_SHAPES, write_moe_checkpoint  # noqa: E402
from loadtests.lib.load_memory import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/qkv-qwen3-moe-1b-bf16")
    ap.add_argument("--shape", default="qwen3-moe-1b-shape", choices=list(MOE_SHAPES))
    ap.add_argument("--dtype", default="bfloat16", help="dtype to load into")
    ap.add_argument("--out", default="results/moe_load_memory.json")
    args = ap.parse_args()
    directory = Path(args.dir)
    if not (directory / "config.json").is_file():
        print(f"writing a random {args.shape} checkpoint to {directory} (once) ...", flush=True)
        write_moe_checkpoint(directory, args.shape)
    report(str(directory), args.dtype, args.out, "checkpoint files (bf16, per-expert tensors)",
           {"shape": args.shape, "dtype": args.dtype})

if __name__ == "__main__":
    main()
