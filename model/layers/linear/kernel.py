"""The CPU kernel for weight-only quantized matmuls (`csrc/quant_matmul.cpp`), built with PyTorch's
extension mechanism on first use into the same per-user cache as the paged-attention kernel.

Why our own kernel: torch 2.13's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are
vectorised only for bfloat16 activations on x86 (float32 activations take a path 4-25x slower
than the dense float32 matmul), and bfloat16 activations put a single matmul 3e-3 (relative) off
the format's float32 math. This kernel keeps activations and sums in float32.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from model.layers.paged_attention import _put_ninja_on_path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "quant_matmul.cpp"
_NAME = "qkv_quant_matmul"
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _build_directory() -> Path:
    """`QKV_KERNEL_CACHE` or ~/.cache/qkv-serve, per torch version, CPU flags and source hash."""
    root = Path(os.environ.get("QKV_KERNEL_CACHE") or Path.home() / ".cache" / "qkv-serve")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    tag = hashlib.sha256(f"{platform.machine()} {flags}".encode() + _SOURCE.read_bytes()).hexdigest()[:10]
    return root / f"quant_matmul-torch{torch.__version__.replace('+', '_')}-{tag}"


def kernel_available() -> bool:
    """Build (first call, a minute or two) or load the kernel; False, with one warning, when it
    cannot be built (the layers then dequantize blocks of rows and use the dense matmul)."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return _state["loaded"]


def _load() -> bool:
    try:
        from torch.utils import cpp_extension

        directory = _build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        library = directory / f"{_NAME}.so"
        with open(directory / "build.flock", "w") as turn:  # processes starting together take turns
            fcntl.flock(turn, fcntl.LOCK_EX)
            if library.is_file():
                try:
                    torch.ops.load_library(str(library))
                    return hasattr(torch.ops.qkv_quant, "quant_matmul")
                except OSError as exc:
                    logger.warning("rebuilding the quantized-matmul kernel, %s did not load: %s", library, exc)
                    library.unlink(missing_ok=True)
            (directory / "lock").unlink(missing_ok=True)  # torch's lock, left by a killed build
            _put_ninja_on_path()
            cpp_extension.load(name=_NAME, sources=[str(_SOURCE)], build_directory=str(directory),
                               extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
        return hasattr(torch.ops.qkv_quant, "quant_matmul")
    except Exception as exc:  # any build or load failure: the dequantizing path
        logger.warning("quantized-matmul kernel unavailable, dequantizing blocks of rows instead: %s: %s",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bits: int, group_size: int) -> torch.Tensor:
    """x (M, K) float32 -> (M, N) float32 through the kernel (see csrc/quant_matmul.cpp)."""
    empty = scales.new_empty(0)
    return torch.ops.qkv_quant.quant_matmul(x, qweight, scales, empty if offsets is None else offsets,
                                            bits, group_size)
