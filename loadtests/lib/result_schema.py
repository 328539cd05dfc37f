"""What a result file holds, and what every JSON a script writes carries: the keys the docs
render (docs/generate.py) and the provenance fields (the command that ran, a clean git commit or
the dirty tree recorded with --allow-dirty, the machine). Only the standard library: the docs build
loads this file on its own."""

from __future__ import annotations

import re
from typing import Any

REQUIRED = ("benchmark", "command", "date", "commit", "machine", "table")
MACHINE_KEYS = ("cpu_model", "cores", "copy_bandwidth_gb_s", "matmul_peak_gflops", "gpu")
PROVENANCE_KEYS = ("command", "date", "commit", "dirty", "allow_dirty", "source_digest", "machine")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


def problems(doc: Any) -> list[str]:
    """What a result file lacks to be rendered (empty: it is complete); the docs build and
    tests/docs/test_docs_sources.py check every docs/results/*.json with it."""
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


def provenance_problems(doc: Any) -> list[str]:
    """What a JSON lacks to say where its figures came from (empty: nothing): the command line
    that ran, its date, a clean git commit (or `dirty` with `allow_dirty`), and the machine (CPU
    model, cores, GPU name or null, torch version)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    out = []
    command = doc.get("command")
    if not isinstance(command, str) or "python " not in command:
        out.append(f"command {command!r} is not the command line that ran")
    if not isinstance(doc.get("date"), str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        out.append(f"date {doc.get('date')!r} is not an ISO date")
    out += tree_problems(doc.get("commit"), doc.get("dirty"), doc.get("allow_dirty") is True)
    machine = doc.get("machine")
    if not isinstance(machine, dict):
        return out + ["machine is not an object"]
    if not isinstance(machine.get("cpu_model"), str) or not machine["cpu_model"]:
        out.append("machine.cpu_model is missing")
    if not isinstance(machine.get("cores"), int) or machine["cores"] < 1:
        out.append("machine.cores is missing")
    if "gpu" not in machine or not isinstance(machine["gpu"], (str, type(None))):
        out.append("machine.gpu is missing (the GPU's name, or null)")
    if not isinstance(machine.get("torch"), str) or not machine["torch"]:
        out.append("machine.torch (the torch version) is missing")
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


def tree_problems(commit: Any, dirty: Any, allow_dirty: bool) -> list[str]:
    """Why a run at (`commit`, `dirty`) cannot publish a result file (empty: it can)."""
    out = []
    if not isinstance(commit, str) or not COMMIT.match(commit):
        out.append(f"commit {commit!r} is not a git commit (run from a git checkout; a run elsewhere is "
                   "adopted by a clean checkout with the same source digest, loadtests.lib.provenance.adopt)")
    if not isinstance(dirty, bool):
        out.append(f"dirty must be true or false, got {dirty!r}")
    elif dirty and not allow_dirty:
        out.append("the tree had uncommitted changes: commit them and run again, or pass --allow-dirty "
                   "(the file then records allow_dirty)")
    return out
