"""What one image costs on this machine: preprocessing (HF's image processor), the vision encoder
(time, peak memory), and what its embeddings take in the encoder cache, at real tower sizes with
random weights (nothing downloaded).

Towers: Qwen2-VL-2B/7B's (675M parameters: 32 blocks of 1280, patches of 14, 2x2 merge to 1536
wide tokens) at several resolutions, and LLaVA-1.5-7B's CLIP ViT-L/14-336 with its projector to 4096.
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
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402
from loadtests.lib.rooflines import matmul_gflops  # noqa: E402

QWEN2_VL_TOWER = VisionConfig(kind="qwen2_vl", image_token_id=0, hidden_size=1280, depth=32, num_heads=16,
                              intermediate_size=5120, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
QWEN2_VL_OUT = 1536  # Qwen2-VL-2B's decoder width (7B: 3584, the merger's last layer only)
SIZES = ((224, 224), (448, 448), (672, 448))  # width x height


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


# LLaVA-1.5-7B: CLIP ViT-L/14 at 336 (features of layer -2, class token dropped), projector to 4096.
LLAVA_15 = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 1000,
            "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                            "num_hidden_layers": 1, "num_attention_heads": 32, "vocab_size": 1024},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                              "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                              "patch_size": 14}}


def clip_flops(v: VisionConfig, layers: int, tokens: int, out_dim: int) -> float:
    """Multiply-adds x 2 of one image through a CLIP tower's first `layers` layers and LLaVA's projector."""
    d, f, n = v.hidden_size, v.intermediate_size, (v.image_size // v.patch_size) ** 2 + 1
    embed = 2 * (n - 1) * v.in_channels * v.patch_size ** 2 * d
    blocks = layers * (2 * n * d * (4 * d + 2 * f) + 4 * n * n * d)
    return float(embed + blocks + 2 * tokens * (d * out_dim + out_dim * out_dim))


def llava_rows(repeats: int, peak_gflops: float) -> tuple[list[list], list[dict]]:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from model.models.clip import used_layers
    from model.models.registry import ARCHITECTURES, build_model

    cfg = ARCHITECTURES["LlavaForConditionalGeneration"].parse_config(LLAVA_15, False)
    torch.manual_seed(0)
    net = build_model(cfg).eval()
    params = sum(p.numel() for n, p in net.named_parameters() if n.startswith(net.float_prefixes))
    side = cfg.vision.image_size
    processor = ImageProcessor(CLIPImageProcessorPil(size={"shortest_edge": side},
                                                     crop_size={"height": side, "width": side}), cfg.vision)
    r = measure(processor, net.encode_image, image(640, 480), repeats)
    gflops = clip_flops(cfg.vision, used_layers(cfg.vision), r["tokens"], cfg.d_model) / r["encode_s"] / 1e9
    r |= {"tower": "llava-1.5 clip", "params": params, "width": side, "height": side, "gflops": gflops}
    row = [f"LLaVA-1.5 CLIP-L/336 ({params / 1e6:.0f}M)", f"640x480 -> {side}x{side}", r["tokens"],
           f"{r['preprocess_s'] * 1e3:.0f}", f"{r['encode_s']:.2f}", f"{r['encode_s'] / r['tokens'] * 1e3:.1f}",
           f"{gflops:.0f}", f"{gflops / peak_gflops:.2f}", f"{r['peak_bytes'] / 2**20:.0f}",
           f"{r['cache_bytes'] / 2**20:.2f}"]
    return [row], [r]


COLUMNS = ["tower", "image", "tokens", "preprocess ms", "encode s", "encode ms/token", "GFLOP/s",
           "x matmul peak", "peak extra MiB", "cache MiB"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2, help="encodes per image (the best is kept)")
    add_result_args(ap, "results/bench_image_cost.json")
    args = ap.parse_args()
    peak = matmul_gflops(torch.device("cpu"), torch.float32)
    rows, raw = qwen2_vl_rows(args.repeats, peak)
    more_rows, more_raw = llava_rows(args.repeats, peak)
    rows, raw = rows + more_rows, raw + more_raw
    print_table(COLUMNS, rows)
    write_result(args.out, "bench_image_cost", COLUMNS, rows, raw={"matmul_peak_gflops": peak, "images": raw},
                 note=args.note, title="Cost per image: preprocessing, the vision encoder, the encoder cache")


if __name__ == "__main__":
    main()
