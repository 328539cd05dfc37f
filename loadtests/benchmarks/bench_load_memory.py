"""Peak memory while loading a checkpoint: a random Qwen2.5-0.5B-shaped model (494M parameters)
saved in bf16, loaded into float32 on the CPU, in a fresh process.

Reports the process's peak resident set (VmHWM) against its resident set just before the
load, and compares the growth with one float32 copy of the model (the lower bound).

    .venv/bin/python loadtests/benchmarks/bench_load_memory.py [--dir /tmp/qkv-qwen-shape] [--out results/bench_load_memory.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.checkpoints import write_random_checkpoint  # noqa: E402
from loadtests.lib.load_memory import report  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/qkv-qwen2.5-0.5b-shape-bf16")
    ap.add_argument("--shape", default="qwen2.5-0.5b-shape")
    ap.add_argument("--dtype", default="float32", help="dtype to load into")
    ap.add_argument("--out", default="results/bench_load_memory.json")
    args = ap.parse_args()
    if not (Path(args.dir) / "config.json").is_file():
        write_random_checkpoint(args.dir, args.shape)
    report(args.dir, args.dtype, args.out, "checkpoint files (bf16)")


if __name__ == "__main__":
    main()
