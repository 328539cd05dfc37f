"""Result files, and every JSON a script writes, with where its figures came from.

A result file (docs/results/NAME.json) holds one run's table and its provenance, written by the
script that measured it, so that the docs render it (`<!-- generated: bench NAME -->`,
docs/generate.py) instead of a retyped copy:

    {"benchmark": "bench_engine", "title": "...",
     "command": "python loadtests/benchmarks/bench_engine.py --out docs/results/bench_engine.json",
     "date": "2026-12-03", "commit": "1b45cfd", "dirty": false, ("allow_dirty": true,)
     "source_digest": "...",
     "machine": {"cpu_model", "cores", "torch_threads", "load_average_1m", "copy_bandwidth_gb_s",
                 "matmul_peak_gflops", "gpu", "torch", "python"},
     "table": {"columns": [...], "rows": [[...], ...]}, ("tables": {NAME: {"columns", "rows"}},)
     "note": "...", "source": "...", "raw": {... the script's own numbers ...}}

`note` says what the reader must know to trust the figures (a shared machine, a quick run);
`source`, where they were not measured by the command written (they never should be).
A file under docs/results/ is refused when the tree had uncommitted changes (or is no git
checkout) unless `--allow-dirty` is given, which the file then records; the refusal comes when
the command line is parsed, before the run.

    from loadtests.lib.results import add_result_args, print_table, write_result
    add_result_args(ap, "results/bench_engine.json")    # --out PATH, --note TEXT, --allow-dirty
    args = ap.parse_args()                                # notes the git state, refuses a dirty tree
    print_table(columns, rows)
    write_result(args.out, "bench_engine", columns, rows, raw=res, note=args.note)

Any other JSON a script writes (a profile, a memory report) goes through `write_json`, which adds
the same provenance fields. What the files must hold is checked by loadtests/lib/result_schema.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadtests.lib import provenance
from loadtests.lib.result_schema import PROVENANCE_KEYS, problems, provenance_problems, tree_problems

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "docs" / "results"  # the published result files


class RefusedResult(RuntimeError):
    """A file for docs/results/ whose provenance is incomplete or from a dirty tree."""


_run: provenance.RunStart | None = None  # the run's start (command line parsed): the code that ran


def add_result_args(ap: argparse.ArgumentParser, default_out: str | None) -> None:
    """`--out PATH` (the result file; None: none written), `--note TEXT` (kept in it) and
    `--allow-dirty`. Parsing the command line then notes the git state, before the run, and
    refuses (exit status 2) a docs/results/ file that a dirty tree would write."""
    ap.add_argument("--out", default=default_out, help="the result file to write (docs/results/NAME.json for the docs)")
    ap.add_argument("--note", default=None, help="what a reader must know about this run (kept in the result file)")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="write a docs/results/ file from a tree with uncommitted changes (the file records it)")
    parse = ap.parse_known_args

    def parse_and_start(args: list[str] | None = None,
                        namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = parse(args, namespace)
        try:
            start_run(parsed.out, parsed.allow_dirty)
        except RefusedResult as exc:
            ap.error(str(exc))
        return parsed, rest

    ap.parse_known_args = parse_and_start  # type: ignore[method-assign]  # argparse has no after-parse hook


def start_run(out: str | Path | None, allow_dirty: bool = False) -> provenance.RunStart:
    """Note the run's command line and git state now; raises RefusedResult if `out` is a
    published file (under docs/results/) that this tree may not write."""
    global _run
    _run = provenance.start(allow_dirty)
    if out is not None and published(out):
        why = tree_problems(_run.commit, _run.dirty, allow_dirty)
        if why:
            raise RefusedResult(f"{out}: {'; '.join(why)}")
    return _run


def published(out: str | Path) -> bool:
    """Whether `out` is a result file the docs render (under docs/results/)."""
    return Path(out).resolve().is_relative_to(RESULTS_DIR.resolve())


def print_table(columns: list[str], rows: list[list[Any]]) -> None:
    """The table as markdown, as the docs will show it."""
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join("" if v is None else str(v) for v in row) + " |")


def write_result(out: str | Path, benchmark: str, columns: list[str], rows: list[list[Any]],
                 raw: Any = None, note: str | None = None, title: str | None = None,
                 device: str = "cpu", tables: dict[str, tuple[list[str], list[list[Any]]]] | None = None,
                 stamp: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the result file `out` and return it: the table, `tables` (more tables of the same
    run, by name: the docs render one with `bench NAME TABLE`), and the provenance, `stamp` if
    given (a run recorded elsewhere), else this run's with the machine measured on `device`."""
    doc: dict[str, Any] = {"benchmark": benchmark}
    if title:
        doc["title"] = title
    doc |= stamp if stamp is not None else _stamp(device, rooflines=True)
    doc["table"] = {"columns": list(columns), "rows": [list(r) for r in rows]}
    if tables:
        doc["tables"] = {name: {"columns": list(c), "rows": [list(r) for r in rs]} for name, (c, rs) in tables.items()}
    if note:
        doc["note"] = note
    if raw is not None:
        doc["raw"] = raw
    missing = problems(doc)
    if missing:
        raise ValueError(f"result {benchmark}: {'; '.join(missing)}")
    return _write(Path(out), doc)


def write_json(out: str | Path, doc: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Write `doc`, a script's own JSON, to `out` with this run's provenance fields added (the
    machine without its rooflines, which take seconds to measure); returns what was written."""
    clash = sorted(set(doc) & set(PROVENANCE_KEYS))
    if clash:
        raise ValueError(f"{out}: the document's keys {clash} are the provenance's")
    return _write(Path(out), doc | _stamp(device, rooflines=False))


def _stamp(device: str, rooflines: bool) -> dict[str, Any]:
    return provenance.stamp(_run or provenance.start(), device, rooflines)


def _write(path: Path, doc: dict[str, Any]) -> dict[str, Any]:
    if published(path):
        why = provenance_problems(doc)
        if why:
            raise RefusedResult(f"{path}: {'; '.join(why)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
    return doc
