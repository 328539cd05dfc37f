"""Where a measurement came from: the command that ran it, the code (the git commit, and whether
the tree had uncommitted changes), and the machine (CPU model, cores, GPU, torch).

`start()` reads the command line and the git state when a run starts, before its own work can
change the tree; `stamp()` turns that into the fields every JSON a script writes carries
(loadtests/lib/results.py adds them). A run on a machine whose copy of the tree has no git history
(the GPU machine receives the files without `.git`, or with a stale one) cannot name its commit:
it records a digest of its source files instead, and `adopt()` gives such a record the commit of
a clean checkout whose source has the same digest, never a commit typed by hand.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.lib.result_schema import tree_problems

REPO = Path(__file__).resolve().parents[2]
# The code a measurement depends on: what the source digest covers.
SOURCE_DIRS = ("model", "service", "loadtests", "tests")
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
SOURCE_FILES = ("pyproject.toml",)
SKIPPED_DIRS = ("__pycache__", "build", "node_modules")


@dataclass(frozen=True)
class RunStart:
    """What a run records as it starts."""

    command: str
    commit: str | None  # HEAD's short hash; None outside a git checkout
    dirty: bool  # tracked files differ from HEAD (True where there is no HEAD to compare with)
    source_digest: str
    allow_dirty: bool = False  # --allow-dirty: the run may publish from a dirty tree, and says so


def start(allow_dirty: bool = False, root: Path = REPO) -> RunStart:
    """The command line, git state and source digest of this process's checkout, now."""
    commit, dirty = git_state(root)
    return RunStart(command_line(root), commit, dirty, source_digest(root), allow_dirty)


def stamp(run: RunStart, device: str = "cpu", rooflines: bool = False) -> dict[str, Any]:
    """The provenance fields of a JSON written now by the run `run`: command, date, commit,
    dirty (and allow_dirty when given), source_digest and `machine(device, rooflines)`. The
    machine is measured now, after the benchmark, so that it does not disturb it."""
    fields: dict[str, Any] = {"command": run.command, "date": datetime.date.today().isoformat(),
                              "commit": run.commit, "dirty": run.dirty}
    if run.allow_dirty:
        fields["allow_dirty"] = True
    fields["source_digest"] = run.source_digest
    fields["machine"] = machine(device, rooflines)
    return fields


def adopt(fields: dict[str, Any], root: Path = REPO) -> dict[str, Any]:
    """`fields` (a stamp written by a run on another machine) with the commit of the checkout at
    `root` when that run could not name a clean commit itself and its source digest equals the
    checkout's, which must be clean; otherwise `fields` unchanged."""
    if not tree_problems(fields.get("commit"), fields.get("dirty"), False):
        return fields
    here = start(root=root)
    if fields.get("source_digest") != here.source_digest or tree_problems(here.commit, here.dirty, False):
        return fields
    return {**fields, "commit": here.commit, "dirty": False,
            "commit_from": f"the checkout that wrote this file: its source digest equals the run's (the run's "
                           f"own git state: commit {fields.get('commit')!r}, dirty {fields.get('dirty')!r})"}


def command_line(root: Path = REPO) -> str:
    """How this process was started, with the script's path relative to the repository and
    without `--note` (the file keeps the note on its own)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(root)
    except ValueError:
        pass
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--note="):
            skip = False
            continue
        skip = arg == "--note"
        if not skip:
            args.append(arg)
    return shlex.join(["python", str(script), *args])


def git_state(root: Path = REPO) -> tuple[str | None, bool]:
    """(HEAD's short hash, whether tracked files have changes); (None, True) outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None, True  # a copy of the tree inside some other checkout: not this tree's history
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, True


def source_digest(root: Path = REPO) -> str:
    """sha256 of the source files under `root` (SOURCE_DIRS' files of SOURCE_SUFFIXES, and
    SOURCE_FILES), each path and its bytes, in path order: equal digests, the same code."""
    files = [root / name for name in SOURCE_FILES if (root / name).is_file()]
    for top in SOURCE_DIRS:
        for folder, dirs, names in os.walk(root / top):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")]
            files += [Path(folder) / n for n in names if n.endswith(SOURCE_SUFFIXES)]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def machine(device: str = "cpu", rooflines: bool = False) -> dict[str, Any]:
    """CPU model and cores, torch's threads and version, the GPU's name if `device` is one; with
    `rooflines`, the copy bandwidth and float32 matmul peak measured on `device`
    (loadtests/lib/rooflines.py)."""
    import torch

    from loadtests.lib.rooflines import copy_bandwidth_gbs, matmul_gflops

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    facts: dict[str, Any] = {"cpu_model": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                             "load_average_1m": round(os.getloadavg()[0], 2)}
    if rooflines:
        facts["copy_bandwidth_gb_s"] = round(copy_bandwidth_gbs(dev), 1)
        facts["matmul_peak_gflops"] = round(matmul_gflops(dev, torch.float32), 1)
    facts |= {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "torch": torch.__version__,
              "python": platform.python_version()}
    return facts


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's name elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
