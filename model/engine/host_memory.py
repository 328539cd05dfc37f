"""Keeping the memory a CPU step frees for the next step, instead of handing it back to the kernel.

glibc's malloc serves a block above its mmap threshold (128 KiB, raised up to 32 MiB as such
blocks are freed) with a fresh mmap, unmapped again on free, and returns the free top of its heap
to the kernel past its trim threshold. A step's activations are such blocks (one 2,048-token
prefill chunk of the Qwen2.5-0.5B shape: 40 MiB per MLP product; 64 decode rows of its logits:
39 MiB), so every step took its buffers again as zeroed pages from the kernel: 1.0 million page
faults in one float32 prefill of 4 x 512 tokens. With every block served from the heap and the
heap never trimmed, a step reuses the pages the last one freed: 57K faults, all in the first
steps, and that prefill ran 1.27x as fast (int8: 1.06x; docs/cpu.md). llama.cpp gets the same
by allocating its compute buffers once.

The cost: the process keeps the most memory its steps ever used together (the heap does not
shrink) and the engine's resident size stays at that peak. It is process-wide and applies to
what is allocated after the call. `QKV_KEEP_FREED_MEMORY=0` leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_FREED_MEMORY_ENV = "QKV_KEEP_FREED_MEMORY"  # "0" keeps glibc's default

_APPLIED: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Serve every later allocation from malloc's heap (no mmap per block) and never trim it.
    True when glibc took both settings (once per process; later calls answer the same); False
    on another C library or when `QKV_KEEP_FREED_MEMORY=0`."""
    if "applied" not in _APPLIED:
        _APPLIED["applied"] = _apply()
    return _APPLIED["applied"]


def _apply() -> bool:
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator is left as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The largest trim threshold an int holds: never give the heap's top back.
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and mallopt(M_MMAP_MAX, 0) == 1
    if ok:
        logger.info("malloc keeps freed memory for reuse (no per-block mmap, no trim): "
                    "QKV_KEEP_FREED_MEMORY=0 turns this off")
    return ok
