"""KV blocks a sliding-window sequence holds as it decodes, with out-of-window blocks given back
(the engine's default for models whose every layer is windowed) and kept (as before): a random
Mistral-shaped checkpoint (every layer windowed) saved by transformers, one greedy request, the
blocks its table really holds after each step. Prints a table and writes JSON.

    .venv/bin/python loadtests/benchmarks/window_blocks.py [--window 256 --prompt 512 --tokens 2048 --block-size 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import write_json  # noqa: E402


def write_mistral(directory: Path, window: int, max_len: int) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, max_position_embeddings=max_len,
                        sliding_window=window, bos_token_id=None, eos_token_id=0, pad_token_id=None)
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(directory)
    return directory


def held_blocks(directory: Path, prompt: list[int], tokens: int, block_size: int, release: bool) -> list[int]:
    """Blocks the request's table holds after each step (released entries not counted)."""
    from model import LLM, SamplingParams
    from model.config import EngineConfig

    llm = LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(block_size=block_size))
    engine = llm.engine
    if not release:
        engine.scheduler.window = None  # the engine as it was: every block kept to the end
    engine.add_request("r", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    held = []
    while engine.has_unfinished():
        engine.step()
        held += [len(s.block_table) - s.num_released_blocks for s in engine.scheduler.running]
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", default="window_blocks.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_mistral(Path(tmp), args.window, args.prompt + args.tokens)
        prompt = torch.randint(1, 512, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
        runs = {name: held_blocks(directory, prompt, args.tokens, args.block_size, release)
                for name, release in (("released", True), ("kept", False))}
    from model.layers.kv_cache import KVCache

    # Mistral-7B v0.1's shape (32 layers, 8 KV heads of 128, bf16): what one block costs there.
    per_block = KVCache.bytes_per_block(32, args.block_size, 8, 128, torch.bfloat16)
    rows = {name: {"peak_blocks": max(h), "final_blocks": h[-1], "mean_blocks": sum(h) / len(h),
                   "mistral_7b_peak_mib": max(h) * per_block / 2**20} for name, h in runs.items()}
    print(f"window {args.window}, prompt {args.prompt}, {args.tokens} tokens, blocks of {args.block_size} "
          f"(window = {args.window / args.block_size:.0f} blocks)")
    print(f"{'blocks':10} {'peak':>6} {'final':>6} {'mean':>8} {'Mistral-7B MiB at peak':>24}")
    for name, r in rows.items():
        print(f"{name:10} {r['peak_blocks']:6d} {r['final_blocks']:6d} {r['mean_blocks']:8.1f} "
              f"{r['mistral_7b_peak_mib']:24.0f}")
    write_json(args.json, {"args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
