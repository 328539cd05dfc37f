"""What one image costs on this machine: preprocessing (HF's image processor), the vision encoder
(time, peak memory), and what its embeddings take in the encoder cache, at real tower sizes with
random weights (nothing downloaded).

Towers: Qwen2-VL-2B/7B's (675M parameters: 32 blocks of 1280, patches of 14, 2x2 merge to 1536
wide tokens) at several resolutions, and LLaVA-1.5's CLIP ViT-L/14-336 when its module is present.
The encoder's rate is set against the float32 matmul peak measured in the same run (a ratio, so
the shared machine's noise shows as less than it would in seconds).

    .venv/bin/python loadtests/benchmarks/bench_image_cost.py [--repeats 2] [--out docs/results/bench_image_cost.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.config import VisionConfig  # noqa: E402
from model.multimodal.processor import ImageProcessor  # noqa: E402
from loadtests.tools.results import add_result_args, matmul_gflops, print_table, write_result  # noqa: E402

QWEN2_VL_TOWER = VisionConfig(kind="qwen2_vl", image_token_id=0, hidden_size=1280, depth=32, num_heads=16,
                              intermediate_size=5120, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
QWEN2_VL_OUT = 1536  # Qwen2-VL-2B's decoder width (7B: 3584, the merger's last layer only)
SIZES = ((224, 224), (448, 448), (672, 448))


def status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Start VmHWM (the peak resident set) again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def tower_flops(v: VisionConfig, patches: int, out_dim: int) -> float:
    """Multiply-adds x 2 of one image's encode: patch embedding, the blocks' projections and MLPs,
    attention over all patches of the frame, the merger."""
    d, f = v.hidden_size, v.intermediate_size
    embed = 2 * patches * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * d
    blocks = v.depth * (2 * patches * d * (4 * d + 2 * f) + 4 * patches ** 2 * d)
    m = v.spatial_merge_size ** 2
    merger = 2 * (patches // m) * (m * d) * (m * d + out_dim)
    return float(embed + blocks + merger)


def image(width: int, height: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(height, width, 3) * 255).astype("uint8"))


@torch.inference_mode()
def measure(processor: ImageProcessor, encode, pic, repeats: int) -> dict:
    start = time.perf_counter()
    data = processor.preprocess(pic)
    prep = time.perf_counter() - start
    tokens = processor.num_tokens(data)
    best, peak = float("inf"), 0
    for _ in range(repeats):
        reset_peak()
        before = status("VmRSS")
        start = time.perf_counter()
        out = encode(data)
        best = min(best, time.perf_counter() - start)
        peak = max(peak, status("VmHWM") - before)
    assert out.shape[0] == tokens
    return {"tokens": tokens, "preprocess_s": prep, "encode_s": best, "peak_bytes": peak,
            "cache_bytes": out.numel() * out.element_size(), "patches": int(data["pixel_values"].shape[0])}


def qwen2_vl_rows(repeats: int, peak_gflops: float) -> tuple[list[list], list[dict]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from model.models.qwen2_vl_vision import Qwen2VisionTower

    torch.manual_seed(0)
    tower = Qwen2VisionTower(QWEN2_VL_TOWER, QWEN2_VL_OUT).eval()
    params = sum(p.numel() for p in tower.parameters())
    processor = ImageProcessor(Qwen2VLImageProcessorPil(), QWEN2_VL_TOWER)

    def encode(data):
        return tower(data["pixel_values"], tuple(int(x) for x in data["image_grid_thw"][0]))

    rows, raw = [], []
    for w, h in SIZES:
        r = measure(processor, encode, image(w, h), repeats)
        gflops = tower_flops(QWEN2_VL_TOWER, r["patches"], QWEN2_VL_OUT) / r["encode_s"] / 1e9
        r |= {"tower": "qwen2-vl", "params": params, "width": w, "height": h, "gflops": gflops}
        raw.append(r)
        rows.append([f"Qwen2-VL ({params / 1e6:.0f}M)", f"{w}x{h}", r["tokens"], f"{r['preprocess_s'] * 1e3:.0f}",
                     f"{r['encode_s']:.2f}", f"{r['encode_s'] / r['tokens'] * 1e3:.1f}", f"{gflops:.0f}",
                     f"{gflops / peak_gflops:.2f}", f"{r['peak_bytes'] / 2**20:.0f}", f"{r['cache_bytes'] / 2**20:.2f}"])
    return rows, raw


COLUMNS = ["tower", "image", "tokens", "preprocess ms", "encode s", "encode ms/token", "GFLOP/s",
           "x matmul peak", "peak extra MiB", "cache MiB"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="encodes per image (the best is kept)")
    add_result_args(ap, "results/bench_image_cost.json")
    args = ap.parse_args()
    peak = matmul_gflops(torch.device("cpu"), torch.float32)
    rows, raw = qwen2_vl_rows(args.repeats, peak)
    print_table(COLUMNS, rows)
    write_result(args.out, "bench_image_cost", COLUMNS, rows, raw={"matmul_peak_gflops": peak, "images": raw},
                 note=args.note, title="Cost per image: preprocessing, the vision encoder, the encoder cache")


if __name__ == "__main__":
    main()
