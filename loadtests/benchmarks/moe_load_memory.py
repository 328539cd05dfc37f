"""Peak memory while loading a mixture-of-experts checkpoint: a random Qwen3-MoE-shaped model
(1.18B parameters: 16 layers, 64 experts of 256, top-8) built and saved in bf16 with
`transformers` (its per-expert tensors, as published MoE checkpoints store them), loaded by
our loader in a fresh process, which stacks each layer's experts into (E, ...) parameters.

The checkpoint is written once (to --dir, if it holds no config.json yet). Reports the
process's peak resident set against its resident set just before the load, next to the
checkpoint's size and one copy of the model at the target dtype (the lower bound), with
`loadtests/benchmarks/bench_load_memory.py`'s measurement.

    .venv/bin/python loadtests/benchmarks/moe_load_memory.py [--dir /tmp/qkv-qwen3-moe-1b-bf16] [--dtype bfloat16]
    .venv/bin/python loadtests/benchmarks/moe_load_memory.py --shape tiny-moe-shape --dir /tmp/qkv-moe-tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadtests.benchmarks.bench_load_memory import report  # noqa: E402

COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, norm_topk_prob=True,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=0, pad_token_id=None, use_sliding_window=False)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-moe-1b-shape": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                         head_dim=64, intermediate_size=3072, moe_intermediate_size=256, num_experts=64,
                         num_experts_per_tok=8, vocab_size=151936),
    "tiny-moe-shape": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 vocab_size=1000),
}


def write_checkpoint(directory: Path, shape: str) -> None:
    """A random `Qwen3MoeForCausalLM` of `shape`, initialised in bf16 and saved with save_pretrained."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**COMMON, **SHAPES[shape])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(directory, max_shard_size="1GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/qkv-qwen3-moe-1b-bf16")
    ap.add_argument("--shape", default="qwen3-moe-1b-shape", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", help="dtype to load into")
    ap.add_argument("--out", default="results/moe_load_memory.json")
    args = ap.parse_args()
    directory = Path(args.dir)
    if not (directory / "config.json").is_file():
        print(f"writing a random {args.shape} checkpoint to {directory} (once) ...", flush=True)
        write_checkpoint(directory, args.shape)
    report(str(directory), args.dtype, args.out, "checkpoint files (bf16, per-expert tensors)",
           {"shape": args.shape, "dtype": args.dtype})

if __name__ == "__main__":
    main()
