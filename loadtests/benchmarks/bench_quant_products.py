"""The quantized products alone, as a decode step meets them: every linear layer of a Qwen2.5-0.5B-
shaped stack (24 layers of q/o 896x896, k/v 128x896, gate/up 4864x896, down 896x4864: 358M
weights), cycled in order so each weight comes from memory, through the int8-activation kernel
(`quant_matmul_q8`: int8 and int4 weights, groups of 128) and, as the same run's baseline, the
project's dense float32 product (`model.layers.linear.dense.linear`, its kernel as the engine
uses it).

For M rows (1: batch-1 decode; 16 and 64: batched decode), the median time of a pass over the stack, the rate the weights
are read at (their bytes over the time), and each format's time against float32's and int8's.
int4 reads half int8's bytes, so at batch 1 (bound by reading the weights) its time should be
near half int8's; what it costs beyond that is unpacking the 4-bit codes.

    .venv/bin/python loadtests/benchmarks/bench_quant_products.py [--repeats 9] [--out results/bench_quant_products.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from model.layers.linear.dense import kernel_available as dense_kernel, linear  # noqa: E402
from model.layers.linear.kernel import int8_path, quant_matmul_q8  # noqa: E402
from model.layers.linear.quantized import QuantizedLinear  # noqa: E402

LAYER = [(896, 896), (896, 128), (896, 128), (896, 896), (896, 4864), (896, 4864), (4864, 896)]  # (in, out)
LAYERS = 24
GROUP = 128


def stack(bits: int | None) -> list:
    """The stack's weights: float32 tensors (bits None) or QuantizedLinear layers."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(LAYERS):
        for k, n in LAYER:
            w = torch.randn(n, k, generator=gen) * 0.02
            if bits is None:
                out.append(w)
                continue
            layer = QuantizedLinear(k, n, bits, GROUP, False, has_offsets=bits == 4)  # as the engine quantizes
            layer.quantize_from(w)
            out.append(layer)
    return out


def nbytes(weights: list) -> int:
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else
               sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.offsets) if t is not None)
               for w in weights)


def one_pass(weights: list, xs: dict[int, torch.Tensor], path: int) -> float:
    start = time.perf_counter()
    for w in weights:
        if isinstance(w, torch.Tensor):
            linear(xs[w.shape[1]], w)
        else:
            quant_matmul_q8(xs[w.in_features], w.qweight, w.scales, w.offsets, w.bits, w.group_size, path=path)
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=9)
    add_result_args(ap, "results/bench_quant_products.json")
    args = ap.parse_args()
    if int8_path() == 0:
        sys.exit("the quantized-matmul kernel has no integer vector path on this CPU")
    dense_kernel()  # float32 through the engine's own path: the dense kernel where it builds
    stacks = {"float32": stack(None), "int8": stack(8), "int4": stack(4)}
    sizes = {name: nbytes(w) for name, w in stacks.items()}
    # The integer paths this CPU has: 2 AVX-512 VNNI (two blocks a step), 1 AVX2 (what the AVX2
    # machines run), each measured here.
    paths = [p for p in (2, 1) if p <= int8_path()]
    runs = {"float32": (stacks["float32"], 0)}
    for p in paths:
        runs |= {f"int8 path {p}": (stacks["int8"], p), f"int4 path {p}": (stacks["int4"], p)}
    rows, raw = [], {}
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in (896, 4864)}
        times = {name: [] for name in runs}
        for _ in range(args.repeats):  # the runs in turn, so the machine's drift meets each alike
            for name, (weights, p) in runs.items():
                times[name].append(one_pass(weights, xs, p))
        med = {name: statistics.median(t) for name, t in times.items()}
        raw[m] = {"median_s": med, "bytes": sizes}
        for name in runs:
            fmt, p = name.split(" path ") if " path " in name else (name, "")
            int8 = med[f"int8 path {p}"] if p else med["float32"]
            rows.append([m, fmt, p or "-", f"{med[name] * 1e3:.1f}", f"{sizes[fmt] / med[name] / 1e9:.1f}",
                         f"{med[name] / med['float32']:.3f}", f"{med[name] / int8:.3f}"])
    columns = ["rows", "format", "int path", "pass ms", "weights GB/s", "x float32 time", "x int8 time (same path)"]
    print_table(columns, rows)
    write_result(args.out, "bench_quant_products", columns, rows, raw=raw, note=args.note,
                 title="Quantized products over a Qwen2.5-0.5B-shaped stack (int8 activations)")


if __name__ == "__main__":
    main()
