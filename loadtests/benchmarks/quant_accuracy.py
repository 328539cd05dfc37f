"""What weight-only quantization costs in accuracy, against the full-precision model, in one run.

On the trained default (`transformer-base-trained`, fp16 on disk, run in float32) for `none`,
`int8` and `int4` at each group size:

- greedy agreement: 16 prompts cut from the held-out corpus text, 32 greedy tokens each through
  the engine; the share of positions whose token equals full precision's, and the share of
  tokens generated before the first divergence;
- bits per byte on the held-out text: the corpus's last 64 KiB in windows of 256 bytes, as
  tests/model/training/test_trained_default.py measures it (0.978 in float32);
- each quantized scheme three times: the LM head in float, in int8 (`quantize_lm_head: int8`,
  what `auto` picks on the CPU) and quantized as the layers (`true`); llama.cpp quantizes its
  output tensor too (Q6_K in its 4-bit files): the cost of the head alone;
- and each of those again with `quantization_activations=int8` (`/a8`: activations rounded to
  int8 in blocks of 32, as llama.cpp's Q8_0 does), the cost of the integer products.

    .venv/bin/python loadtests/benchmarks/quant_accuracy.py [--groups 32 64 128] [--held-out-bytes 65536]
    .venv/bin/python loadtests/benchmarks/quant_accuracy.py --quick   # a few prompts and 8 KiB, to check it runs
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig  # noqa: E402
from model.training.corpus import build, stdlib_modules  # noqa: E402
from model.training.train import batch_loss  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

MODEL = "transformer-base-trained"
SEQ = 256


def held_out(nbytes: int) -> bytes:
    """The corpus's last `nbytes` (inside the tail held out from training)."""
    text, _ = build(stdlib_modules()[-12:], None)
    data = text.encode("utf-8")
    return data[-nbytes:]


@torch.no_grad()
def bits_per_byte(llm: LLM, data: bytes) -> float:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    windows = ids[: (len(ids) - 1) // SEQ * SEQ + 1]
    batch = torch.stack([windows[s:s + SEQ + 1] for s in range(0, len(windows) - SEQ, SEQ)])
    net = llm.engine.runner.model
    losses = [batch_loss(net, chunk).item() * len(chunk) for chunk in batch.split(16)]
    return sum(losses) / len(batch) / math.log(2)


def prompts_from(data: bytes, n: int, length: int = 48) -> list[list[int]]:
    """n byte prompts at evenly spaced places of the held-out text (byte ids are token ids)."""
    step = (len(data) - length) // n
    return [list(data[i * step:i * step + length]) for i in range(n)]


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefix = 0
    for r, g in zip(ref, got):
        prefix += next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
    return same / total, prefix / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128], help="int4 group sizes")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--held-out-bytes", type=int, default=64 * 1024)
    ap.add_argument("--activations", nargs="+", default=["float32", "int8"], choices=["float32", "int8"],
                    help="quantization_activations of the quantized rows")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 8 tokens, 8 KiB, group 128 only")
    add_result_args(ap, "results/quant_accuracy.json")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.held_out_bytes, args.groups = 4, 8, 8 * 1024, [128]
    data = held_out(args.held_out_bytes)
    prompts = prompts_from(data, args.prompts)
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    schemes = [("none", 128, False, "float32"),
               *[(m, g, head, acts) for acts in args.activations for m, g in [("int8", 128), *[("int4", g) for g in args.groups]]
                 for head in (False, "int8", True) if not (m == "int8" and head is True)]]  # int8: "int8" is True
    rows, ref = [], None
    for method, group, head, acts in schemes:
        t0 = time.perf_counter()
        llm = LLM(args.model, device="cpu", dtype="float32",
                  engine_config=EngineConfig(max_num_seqs=args.prompts, num_kv_blocks=16 * args.prompts,
                                             quantization=method, quantization_group_size=group,
                                             quantize_lm_head=head, quantization_activations=acts))
        if acts == "int8" and not llm.engine.int8_activations:
            raise SystemExit("quantization_activations=int8 did not take: the kernel has no integer path here")
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        ref = outs if ref is None else ref
        same, prefix = agreement(ref, outs)
        bpb = bits_per_byte(llm, data)
        name = (method if method != "int4" else f"int4-g{group}") + {False: "", "int8": "+head8", True: "+head"}[head] + \
            ("/a8" if acts == "int8" else "")
        rows.append({"scheme": name, "quantize_lm_head": head, "activations": acts, "greedy_agreement": same, "greedy_prefix_agreement": prefix,
                     "bits_per_byte": bpb, "seconds": time.perf_counter() - t0})
        print(f"  {name}: greedy agreement {same:.3f}, {bpb:.4f} bits/byte ({rows[-1]['seconds']:.0f} s)", flush=True)
        del llm
    base = rows[0]["bits_per_byte"]
    print(f"{args.model}: {args.prompts} prompts x {args.tokens} greedy tokens; bits/byte on the last "
          f"{len(data)} held-out bytes")
    for r in rows:
        r["bits_per_byte_vs_none"] = r["bits_per_byte"] / base - 1
    columns = ["scheme", "greedy agreement", "before 1st difference", "bits/byte", "vs none"]
    table = [[r["scheme"], f"{r['greedy_agreement']:.3f}", f"{r['greedy_prefix_agreement']:.3f}",
              f"{r['bits_per_byte']:.4f}", f"{r['bits_per_byte_vs_none']:+.2%}"] for r in rows]
    print_table(columns, table)
    if args.out:
        write_result(args.out, "quant_accuracy", columns, table, note=args.note,
                     raw={"model": args.model, "prompts": args.prompts, "tokens": args.tokens,
                          "held_out_bytes": len(data), "rows": rows},
                     title=f"What quantization costs in accuracy ({args.model})")


if __name__ == "__main__":
    main()
