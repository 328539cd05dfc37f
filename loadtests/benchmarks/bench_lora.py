"""What serving LoRA adapters costs: a batch of 16 rows over 4 adapters (4 rows each) against the
same 16 rows on the base model alone, and the same 16 base rows on an engine with LoRA turned on
(the wrappers' cost when no row uses an adapter).

The base is a random checkpoint of a real shape (loadtests/lib/checkpoints.py); the adapters
are random PEFT-format directories (adapter_config.json + adapter_model.safetensors, written
here without `peft`) of rank `--rank` on q/k/v/o and the MLP. Each case: the 16 prompts of
`--prompt` tokens admitted together, `--tokens` greedy tokens each; reported are the whole
batch's generated tokens/s and the steady decode tokens/s (steps after every row's first token).

    .venv/bin/python loadtests/benchmarks/bench_lora.py [--shape qwen2.5-0.5b-shape] [--rank 16] [--out results/bench_lora.json]
    .venv/bin/python loadtests/benchmarks/bench_lora.py --quick   # the tiny shape, a few tokens: checks it runs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.config import EngineConfig  # noqa: E402
from model.engine.builder import build_engine
from model.engine.engine import Engine  # noqa: E402
from model.sampling.params import SamplingParams  # noqa: E402
from loadtests.lib.checkpoints import SHAPES, write_random_checkpoint  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

ROWS, ADAPTERS = 16, 4
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, shape: dict, rank: int, seed: int) -> Path:
    """A random LoRA adapter in PEFT's format for a Llama-family `shape` (config.json fields)."""
    directory.mkdir(parents=True, exist_ok=True)
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head = shape.get("head_dim") or d // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head, shape["num_key_value_heads"] * head
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (fan_in, fan_out) in dims.items():
            part = "self_attn" if name in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "base_model_name_or_path": "random"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def run_batch(engine: Engine, prompts: list[list[int]], loras: list[str | None], tokens: int) -> dict[str, float]:
    """All rows admitted together; generated tokens/s overall and over the decode steps."""
    p = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, p, lora=lora)
    start = time.perf_counter()
    first = {}
    generated = 0
    decode_start = None
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
            first.setdefault(out.request_id, True)
        if decode_start is None and len(first) == len(prompts):
            decode_start, decode_from = time.perf_counter(), generated
    end = time.perf_counter()
    decode_s = end - decode_start if decode_start is not None else 0.0
    return {"tokens_per_s": generated / (end - start),
            "decode_tokens_per_s": (generated - decode_from) / decode_s if decode_s > 0 else 0.0,
            "seconds": end - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b-shape", choices=sorted(SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=2, help="runs per case; the best is kept")
    ap.add_argument("--quick", action="store_true", help="tiny shape, few tokens: checks the script runs")
    add_result_args(ap, "results/bench_lora.json")
    args = ap.parse_args()
    if args.quick:
        args.shape, args.prompt, args.tokens, args.repeats, args.rank = "tiny-llama-shape", 16, 8, 1, 8
    shape = SHAPES[args.shape]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(args.prompt)] for _ in range(ROWS)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = write_random_checkpoint(root / "base", args.shape, torch.float32 if args.quick else torch.bfloat16)
        names = [f"adapter{i}" for i in range(ADAPTERS)]
        modules = {n: str(write_adapter(root / n, shape, args.rank, seed=i)) for i, n in enumerate(names)}
        config = EngineConfig(max_num_seqs=ROWS, max_num_batched_tokens=max(2048, ROWS * args.prompt),
                              enable_prefix_caching=False, max_loras=ADAPTERS, max_lora_rank=args.rank)
        cases = {
            "base model alone": (config, [None] * ROWS),
            "LoRA on, 16 base rows": (config.replace(lora_modules=modules), [None] * ROWS),
            f"{ADAPTERS} adapters x {ROWS // ADAPTERS} rows": (config.replace(lora_modules=modules),
                                                             [names[i % ADAPTERS] for i in range(ROWS)]),
        }
        results = {}
        for label, (cfg, loras) in cases.items():
            engine = build_engine(str(base), cfg, device=args.device, dtype=args.dtype)
            run_batch(engine, prompts[:2], loras[:2], 2)  # warm-up
            runs = [run_batch(engine, prompts, loras, args.tokens) for _ in range(args.repeats)]
            results[label] = max(runs, key=lambda r: r["tokens_per_s"])
            del engine
    ref = results["base model alone"]
    print(f"{args.shape}, rank {args.rank}, {ROWS} rows x {args.prompt} prompt + {args.tokens} tokens")
    columns = ["case", "tok/s", "decode tok/s", "vs base"]
    rows = [[label, f"{r['tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
             f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}"] for label, r in results.items()]
    print_table(columns, rows)
    if args.out:
        write_result(args.out, "bench_lora", columns, rows, raw={"args": vars(args), "results": results},
                     note=args.note, device=args.device,
                     title=f"LoRA: {args.shape}, rank {args.rank}, {ROWS} rows x {args.prompt} prompt + "
                           f"{args.tokens} tokens")

if __name__ == "__main__":
    main()
