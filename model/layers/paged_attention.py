"""Dot-product attention over the paged KV cache, two ways behind one set of functions.

- `fused`: a C++ kernel (`csrc/paged_attention.cpp`) that reads each sequence's keys and values
  where they lie in the block pool, with no per-layer gather copy; built with PyTorch's extension
  mechanism on first use (or by `make install`) into a per-user cache directory.
- `gather`: the reference: copy each sequence's blocks into a contiguous workspace, then SDPA.
  Tests compare the two; it is also the path when the kernel cannot be built (a warning is
  logged once) and on devices other than the CPU.

Shapes: the cache is (num_blocks, block_size, Hkv, d); queries carry Hq = G * Hkv heads, query
head i reads KV head i // G (grouped-query attention; G = 1 is plain multi-head attention).

`window` (every function's last argument; None: the whole context): sliding-window attention as
HF transformers masks it: the query at position i sees key j when i - window < j <= i, i.e. at
most `window` positions, itself included.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_NAME = "qkv_paged_attention"  # the library's file name in the build directory
_lock = threading.Lock()
_state: dict[str, bool] = {}  # "loaded" -> whether the kernel is usable


def build_directory() -> Path:
    """Where the kernel is built: `QKV_KERNEL_CACHE`, else ~/.cache/qkv-serve. The name carries
    the torch version and a hash of this CPU's flags (the build targets the host CPU) and of
    the kernel's source (an edited kernel is built afresh, never loaded stale)."""
    root = Path(os.environ.get("QKV_KERNEL_CACHE") or Path.home() / ".cache" / "qkv-serve")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    tag = hashlib.sha256(f"{platform.machine()} {flags}".encode() + _SOURCE.read_bytes()).hexdigest()[:10]
    return root / f"paged_attention-torch{torch.__version__.replace('+', '_')}-{tag}"


def kernel_available() -> bool:
    """Build (first call, about a minute) or load the fused kernel; False, with one warning
    logged, when it cannot be built (no compiler, no ninja, ...)."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
        return _state["loaded"]


def _load() -> bool:
    """Load the library built before, or build it. Processes that start together (replicas,
    test workers) take turns on an OS file lock, which a killed process releases by dying;
    torch's own build lock is a plain file that a build killed midway leaves behind, making
    every later build wait for it forever, so it is removed when found (only a dead build
    can have left it while we hold ours)."""
    try:
        from torch.utils import cpp_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        library = directory / f"{_NAME}.so"
        with open(directory / "build.flock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            if library.is_file():
                try:
                    torch.ops.load_library(str(library))
                    return hasattr(torch.ops.qkv_paged, "paged_attention")
                except OSError as exc:  # e.g. truncated by a build killed while linking
                    logger.warning("rebuilding the fused kernel, %s did not load: %s", library, exc)
                    library.unlink(missing_ok=True)
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            _put_ninja_on_path()
            cpp_extension.load(
                name=_NAME, sources=[str(_SOURCE)], build_directory=str(directory),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)
        return hasattr(torch.ops.qkv_paged, "paged_attention")
    except Exception as exc:  # any build or load failure means: use the gather path
        logger.warning("fused paged attention unavailable, using the gather path: %s: %s",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False


def _put_ninja_on_path() -> None:
    """The build runs `ninja` from PATH; the `ninja` package installs it beside this Python,
    which is not on PATH when the virtual environment is not activated (Ray workers, cron)."""
    if shutil.which("ninja") is None:
        bindir = str(Path(sys.executable).parent)
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def use_fused(device: torch.device) -> bool:
    """Whether attention on `device` goes through the fused kernel."""
    return device.type == "cpu" and kernel_available()


# ---- fused ---------------------------------------------------------------------------------

def fused_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_seq: torch.Tensor, num_keys: torch.Tensor, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q (T, Hq, d); query t attends to the first num_keys[t] positions (the last `window` of
    them with a window) of the sequence whose block table is block_tables[query_seq[t]]
    -> (T, Hq, d) in q's dtype."""
    if not kernel_available():
        raise RuntimeError("the fused paged-attention kernel could not be built; use the gather path")
    out = torch.ops.qkv_paged.paged_attention(q.float(), k_cache, v_cache, block_tables.long(),
                                              query_seq.long(), num_keys.long(), float(scale), int(window or 0))
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """One query per sequence: q (B, Hq, d), block_tables (B, W), context_lens (B,) -> (B, Hq, d)."""
    seqs = torch.arange(q.shape[0], device=q.device)
    return fused_attention(q, k_cache, v_cache, block_tables, seqs, context_lens, scale, window)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """A chunk of L queries at the end of a context of `context_len` cached positions (the chunk
    included), causal: q (L, Hq, d), block_table (W,) -> (L, Hq, d)."""
    length = q.shape[0]
    num_keys = torch.arange(context_len - length + 1, context_len + 1, device=q.device)
    seqs = torch.zeros(length, dtype=torch.long, device=q.device)
    return fused_attention(q, k_cache, v_cache, block_table[None], seqs, num_keys, scale, window)


# ---- gather (reference) --------------------------------------------------------------------

def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous copies of sequences' K/V: block_tables (B, W) -> two (B, W * block_size, Hkv, d)."""
    b, w = block_tables.shape
    shape = (b, w * k_cache.shape[1], *k_cache.shape[2:])
    flat = block_tables.reshape(-1)
    return (torch.index_select(k_cache, 0, flat).view(shape), torch.index_select(v_cache, 0, flat).view(shape))


def visible_keys(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """(..., num_keys) bool: key j is visible from a query at `query_pos` (any shape) when
    j <= query_pos and, with a window, j > query_pos - window."""
    keys = torch.arange(num_keys, device=query_pos.device)
    pos = query_pos[..., None]
    mask = keys <= pos
    return mask if window is None else mask & (keys > pos - window)


def gather_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """Reference for `paged_decode_attention`: gather, mask past each context (and before its
    window), SDPA."""
    k, v = gather_kv(k_cache, v_cache, block_tables)  # (B, S, Hkv, d)
    s = int(context_lens.max())
    k, v = k[:, :s].transpose(1, 2).to(q.dtype), v[:, :s].transpose(1, 2).to(q.dtype)  # (B, Hkv, S, d)
    mask = visible_keys(context_lens - 1, s, window)[:, None, None, :]  # (B, 1, 1, S)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (B, Hq, 1, d)
    return out.squeeze(2)


def gather_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, context_len: int, scale: float,
                             window: int | None = None) -> torch.Tensor:
    """Reference for `paged_prefill_attention`."""
    length = q.shape[0]
    k, v = gather_kv(k_cache, v_cache, block_table[None])  # (1, S, Hkv, d)
    k = k[:, :context_len].transpose(1, 2).to(q.dtype)  # (1, Hkv, S, d)
    v = v[:, :context_len].transpose(1, 2).to(q.dtype)
    mask = visible_keys(torch.arange(context_len - length, context_len, device=q.device), context_len, window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (1, Hq, L, d)
    return out[0].transpose(0, 1)
