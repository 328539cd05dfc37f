"""Building and loading the project's C++ CPU kernels (paged attention, quantized matmul) with
PyTorch's extension mechanism: built on first use (or by `make install`) into a per-user cache
directory, loaded from there afterwards.

Processes that start together (replicas, test workers) take turns on an OS file lock, which a
killed process releases by dying. torch's own build lock is a plain file that a build killed
midway leaves behind, making every later build wait for it forever, so it is removed when found
(only a dead build can have left it while we hold ours).
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
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


class CppKernel:
    """One kernel: `source` compiled into the library `name`, registering `torch.ops.<namespace>.<op>`.

    `available()` builds or loads it once per process; when that fails it logs `fallback` once
    (as a warning of the `log` logger) and answers False from then on. `on_load` runs once after a
    successful load: the kernel module registers its ops' fake implementations there (shapes and
    dtypes for torch.compile's tracing), which needs the ops to exist."""

    def __init__(self, name: str, source: Path, namespace: str, op: str, directory_prefix: str,
                 fallback: str, log: logging.Logger, on_load: Callable[[], None] | None = None) -> None:
        self.name, self.source, self.namespace, self.op = name, source, namespace, op
        self.directory_prefix, self.fallback, self.log = directory_prefix, fallback, log
        self.on_load = on_load
        self._lock = threading.Lock()
        self.state: dict[str, bool] = {}  # "loaded" -> whether the kernel is usable

    def build_directory(self) -> Path:
        """`QKV_KERNEL_CACHE`, else ~/.cache/qkv-serve. The name carries the torch version and a
        hash of this CPU's flags (the build targets the host CPU) and of the kernel's source (an
        edited kernel is built afresh, never loaded stale)."""
        root = Path(os.environ.get("QKV_KERNEL_CACHE") or Path.home() / ".cache" / "qkv-serve")
        flags = ""
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
        except OSError:
            pass
        tag = hashlib.sha256(f"{platform.machine()} {flags}".encode() + self.source.read_bytes()).hexdigest()[:10]
        return root / f"{self.directory_prefix}-torch{torch.__version__.replace('+', '_')}-{tag}"

    def available(self) -> bool:
        # Answered without the lock once known: a compiled step traces this call, and a lock cannot be traced.
        if "loaded" in self.state:
            return self.state["loaded"]
        with self._lock:
            if "loaded" not in self.state:
                loaded = self._load()
                if loaded and self.on_load is not None:
                    self.on_load()
                self.state["loaded"] = loaded
            return self.state["loaded"]

    def _registered(self) -> bool:
        return hasattr(getattr(torch.ops, self.namespace), self.op)

    def _load(self) -> bool:
        try:
            from torch.utils import cpp_extension

            directory = self.build_directory()
            directory.mkdir(parents=True, exist_ok=True)
            library = directory / f"{self.name}.so"
            with open(directory / "build.flock", "w") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX)
                if library.is_file():
                    try:
                        torch.ops.load_library(str(library))
                        return self._registered()
                    except OSError as exc:  # e.g. truncated by a build killed while linking
                        self.log.warning("rebuilding %s, %s did not load: %s", self.name, library, exc)
                        library.unlink(missing_ok=True)
                stale = directory / "lock"
                if stale.exists():
                    self.log.warning("removing %s, left by a kernel build that did not finish", stale)
                    stale.unlink(missing_ok=True)
                put_ninja_on_path()
                cpp_extension.load(
                    name=self.name, sources=[str(self.source)], build_directory=str(directory),
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    is_python_module=False, verbose=False)
            return self._registered()
        except Exception as exc:  # any build or load failure means: the fallback path
            self.log.warning("%s: %s: %s", self.fallback, type(exc).__name__,
                             str(exc).splitlines()[0] if str(exc) else "")
            return False


def put_ninja_on_path() -> None:
    """The build runs `ninja` from PATH; the `ninja` package installs it beside this Python,
    which is not on PATH when the virtual environment is not activated (Ray workers, cron)."""
    if shutil.which("ninja") is None:
        bindir = str(Path(sys.executable).parent)
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


_FAKES: set[str] = set()


def register_fake_once(qualname: str, fake: Callable[..., torch.Tensor]) -> None:
    """`torch.library.register_fake` for an op of a loaded kernel, once per process (a test that
    resets a kernel's state loads it again; the op and its fake stay registered)."""
    if qualname not in _FAKES:
        torch.library.register_fake(qualname, fake)
        _FAKES.add(qualname)
