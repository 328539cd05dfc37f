"""Benchmark result files: what a benchmark script writes with `--out PATH`, and their schema.

One file holds one current table and where it came from, so that the docs render it
(`<!-- generated: bench NAME -->`, docs/generate.py) instead of a retyped copy:

    {"benchmark": "bench_engine", "title": "...",
     "command": "python loadtests/benchmarks/bench_engine.py --out docs/results/bench_engine.json",
     "date": "2026-12-03", "commit": "1b45cfd" (+ "-dirty" when the tree had changes),
     "machine": {"cpu_model", "cores", "torch_threads", "copy_bandwidth_gb_s", "matmul_peak_gflops", "gpu"},
     "table": {"columns": [...], "rows": [[...], ...]},
     "note": "...", "source": "...", "raw": {... the script's own numbers ...}}

`note` says what the reader must know to trust the figures (a shared machine, a quick run);
`source`, where they were not measured by the command written (they never should be).

    from loadtests.tools.results import add_result_args, print_table, write_result
    add_result_args(ap, "results/bench_engine.json")    # --out PATH and --note TEXT
    print_table(columns, rows)
    write_result(args.out, "bench_engine", columns, rows, raw=res, note=args.note)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ("benchmark", "command", "date", "commit", "machine", "table")
MACHINE_KEYS = ("cpu_model", "cores", "copy_bandwidth_gb_s", "matmul_peak_gflops", "gpu")


def problems(doc: Any) -> list[str]:
    """What a result file lacks (empty: it is complete); the docs build and tests/docs/test_docs_sources.py
    check every docs/results/*.json with it."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    out = [f"missing key {k!r}" for k in REQUIRED if k not in doc]
    machine = doc.get("machine")
    if isinstance(machine, dict):
        out += [f"machine lacks {k!r}" for k in MACHINE_KEYS if k not in machine]
    elif "machine" in doc:
        out.append("machine is not an object")
    out += _table_problems("table", doc.get("table"), "table" in doc)
    tables = doc.get("tables", {})
    if not isinstance(tables, dict):
        out.append("tables is not an object")
    else:
        for name, extra in tables.items():
            out += _table_problems(f"tables.{name}", extra, True)
    return out


def _table_problems(where: str, tbl: Any, present: bool) -> list[str]:
    if not isinstance(tbl, dict):
        return [f"{where} is not an object"] if present else []
    columns, rows = tbl.get("columns"), tbl.get("rows")
    if not isinstance(columns, list) or not columns:
        return [f"{where}.columns must be a non-empty list"]
    if not isinstance(rows, list) or not rows:
        return [f"{where}.rows must be a non-empty list"]
    return [f"{where} row {i} has {len(r)} cells for {len(columns)} columns"
            for i, r in enumerate(rows) if not isinstance(r, list) or len(r) != len(columns)]


_commit_at_start: str | None = None  # the code that ran, read before other work changes the tree


def add_result_args(ap: argparse.ArgumentParser, default_out: str | None) -> None:
    """`--out PATH` (the result file; None: none written) and `--note TEXT` (kept in it); notes
    the git commit now, at the start of the run, for `write_result`."""
    global _commit_at_start
    _commit_at_start = git_commit()
    ap.add_argument("--out", default=default_out, help="the result file to write (docs/results/NAME.json for the docs)")
    ap.add_argument("--note", default=None, help="what a reader must know about this run (kept in the result file)")


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    """The table as markdown, as the docs will show it."""
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join("" if v is None else str(v) for v in row) + " |")


def write_result(out: str | Path, benchmark: str, columns: list[str], rows: list[list[Any]],
                 raw: Any = None, note: str | None = None, title: str | None = None,
                 device: str = "cpu", tables: dict[str, tuple[list[str], list[list[Any]]]] | None = None
                 ) -> dict[str, Any]:
    """Write the result file `out` (the command line, date, commit and `machine_facts(device)` added)
    and return it. The machine is measured after the benchmark, so it does not disturb it.
    `tables`: more tables of the same run, by name (the docs render one with `bench NAME TABLE`)."""
    doc: dict[str, Any] = {"benchmark": benchmark}
    if title:
        doc["title"] = title
    doc |= {"command": command_line(), "date": datetime.date.today().isoformat(),
            "commit": _commit_at_start or git_commit(),
            "machine": machine_facts(device), "table": {"columns": list(columns), "rows": [list(r) for r in rows]}}
    if tables:
        doc["tables"] = {name: {"columns": list(c), "rows": [list(r) for r in rs]} for name, (c, rs) in tables.items()}
    if note:
        doc["note"] = note
    if raw is not None:
        doc["raw"] = raw
    missing = problems(doc)
    if missing:
        raise ValueError(f"result {benchmark}: {'; '.join(missing)}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return doc


def command_line() -> str:
    """How this process was started, with the script's path relative to the repository and
    without `--note` (the file keeps the note on its own)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
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


def git_commit() -> str:
    """The checkout's short commit, `-dirty` when tracked files had changes; "unknown" outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def machine_facts(device: str = "cpu") -> dict[str, Any]:
    """CPU model and cores, torch's threads, and two measured rooflines on `device`: copy
    bandwidth (bytes read plus written per second by a 512 MiB float32 copy, best of 10) and
    the float32 matmul peak (2048 x 2048 x 2048, best of 10); the GPU's name if one is used."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    return {"cpu_model": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "copy_bandwidth_gb_s": round(copy_bandwidth_gbs(dev), 1),
            "matmul_peak_gflops": round(matmul_gflops(dev, torch.float32), 1),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: Any, dtype: Any, size: int = 2048, repeats: int = 10) -> float:
    """The best rate of one size x size matmul, in GFLOP/s."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def copy_bandwidth_gbs(device: Any, mib: int = 512, repeats: int = 10) -> float:
    """Copy bandwidth: bytes read plus bytes written per second, in GB/s."""
    import torch

    src = torch.empty(mib << 18, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9
