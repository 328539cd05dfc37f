"""The generated parts of the docs: each fact has one home in the code or in a result file, and
the pages include it from there instead of retyping it.

A page asks for a part with a marker line, alone on its line (`render_page` replaces it):

    <!-- generated: arguments -->              every argument: `AppArgs` (serve) and `EngineConfig` (LLM)
    <!-- generated: arguments NAME NAME ... --> the rows of those arguments only (a feature page's)
    <!-- generated: speculative_config -->     the keys of `speculative_config`
    <!-- generated: metrics -->                every metric the service exports
    <!-- generated: metrics PREFIX ... -->     the metrics whose name starts with one of these (a feature page's)
    <!-- generated: bench NAME -->             the table of docs/results/NAME.json, with its provenance

Descriptions come from `Field(description=...)` on `service.app.AppArgs` and from the field
metadata of the `model.config.EngineConfig` dataclass (`model.config.described`), which `AppArgs`
takes for the arguments it shares with the engine; metrics from `service.engine.metrics.METRICS`.
docs/hooks.py calls `render_page` for mkdocs; tests call the functions directly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from types import ModuleType, NoneType, UnionType
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
RESULTS_MODULE = REPO / "loadtests" / "tools" / "results.py"  # the result files' writer and schema

MARKER = re.compile(r"^<!-- generated: (?P<kind>[a-z_]+)(?P<args>(?: +[^ ]+)*) *-->$")


@dataclasses.dataclass(frozen=True)
class Argument:
    """One row of the argument reference."""

    name: str
    type: str
    default: str
    applies_to: tuple[str, ...]  # "serve" (an app argument), "LLM" (a keyword of LLM(...)), "EngineConfig"
    description: str


def render_page(markdown: str, results_dir: Path = RESULTS) -> str:
    """`markdown` with every marker line replaced by what it asks for; ValueError for a marker
    that names an unknown part, argument or result file (the docs build fails on it)."""
    out = []
    for line in markdown.split("\n"):
        match = MARKER.match(line.strip())
        out.append(render_marker(match["kind"], match["args"].split(), results_dir) if match else line)
    return "\n".join(out)


def render_marker(kind: str, args: list[str], results_dir: Path = RESULTS) -> str:
    if kind == "arguments":
        return arguments_table(args or None)
    if kind == "speculative_config" and not args:
        return speculative_config_table()
    if kind == "metrics":
        return metrics_table(args or None)
    if kind == "bench" and len(args) == 1:
        return bench_table(args[0], results_dir)
    if kind == "bench" and len(args) == 2:
        return bench_extra_table(args[0], args[1], results_dir)
    raise ValueError(f"unknown docs marker 'generated: {' '.join([kind, *args])}'; known: arguments [NAME ...], "
                     "speculative_config, metrics [PREFIX ...], bench NAME [TABLE]")


# ---- arguments ------------------------------------------------------------------------------

def arguments() -> list[Argument]:
    """Every app argument (in `AppArgs` order), then the `EngineConfig` fields that are not app
    arguments; an argument of both is one row, its description and default the engine's."""
    from model.config import EngineConfig
    from model.llm import LLM
    from service.app import AppArgs

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    engine_types = typing.get_type_hints(EngineConfig)
    llm_params = set(inspect.signature(LLM).parameters) - {"engine_args", "engine_config"}
    rows = []
    for name, info in AppArgs.model_fields.items():
        where = ("serve", *(("LLM",) if name in engine or name in llm_params else ()),
                 *(("EngineConfig",) if name in engine else ()))
        rows.append(Argument(name, type_name(info.annotation) + constraints(info.metadata), format_default(info.default),
                             where, info.description or engine_description(engine.get(name))))
    for name, f in engine.items():
        if name not in AppArgs.model_fields:
            rows.append(Argument(name, type_name(engine_types[name]), format_default(f.default), ("LLM", "EngineConfig"),
                                 engine_description(f)))
    return rows


def engine_description(f: dataclasses.Field | None) -> str:
    return f.metadata.get("description", "") if f is not None else ""


def arguments_table(names: list[str] | None = None) -> str:
    """The argument reference as a markdown table; `names`: only those rows, in that order."""
    rows = {a.name: a for a in arguments()}
    if names:
        unknown = [n for n in names if n not in rows]
        if unknown:
            raise ValueError(f"docs marker names unknown argument(s) {', '.join(unknown)}")
    chosen = [rows[n] for n in names] if names else list(rows.values())
    return table(["Argument", "Type", "Default", "Where", "Description"],
                 [[f"`{a.name}`", f"`{a.type}`", f"`{a.default}`", ", ".join(a.applies_to), a.description]
                  for a in chosen])


def speculative_config_table() -> str:
    """The keys of the `speculative_config` argument (model/engine/spec_decode/config.py)."""
    from model.engine.spec_decode.config import SpeculativeConfig

    hints = typing.get_type_hints(SpeculativeConfig)
    return table(["Key", "Type", "Default", "Description"],
                 [[f"`{f.name}`", f"`{type_name(hints[f.name])}`",
                   "required" if f.default is dataclasses.MISSING else f"`{format_default(f.default)}`",
                   f.metadata.get("description", "")] for f in dataclasses.fields(SpeculativeConfig)])


def type_name(tp: Any) -> str:
    """`int | None`, `"auto" | "cpu"`, `dict[str, Any]`: the annotation as a user reads it."""
    if tp is NoneType or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(tp))
    if origin in (typing.Union, UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    if tp is Any:
        return "Any"
    return getattr(tp, "__name__", str(tp))


def constraints(metadata: list[Any]) -> str:
    """Pydantic's range constraints (`Field(ge=1)`) as ` ≥ 1`."""
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    parts = [f"{symbols[k]} {getattr(m, k)}" for m in metadata for k in symbols if getattr(m, k, None) is not None]
    return f", {', '.join(parts)}" if parts else ""


def format_default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


# ---- metrics --------------------------------------------------------------------------------

def metrics_table(prefixes: list[str] | None = None) -> str:
    """The metrics in `service.engine.metrics.METRICS` (those whose registered name starts with one
    of `prefixes`, if given), under the name Prometheus sees (Ray's `ray_` prefix)."""
    from service.engine.metrics import METRICS, exported_name

    chosen = [m for m in METRICS if prefixes is None or m.name.startswith(tuple(prefixes))]
    if not chosen:
        raise ValueError(f"docs marker 'generated: metrics {' '.join(prefixes or [])}': no metric has such a name")
    suffixes = {"histogram": " (`_bucket`, `_sum`, `_count`)", "counter": "", "gauge": ""}
    return table(["Metric", "Type", "Labels", "Description"],
                 [[f"`{exported_name(m)}`{suffixes[m.kind]}", m.kind, ", ".join(f"`{lb}`" for lb in m.all_labels),
                   m.description] for m in chosen])


# ---- benchmark results ----------------------------------------------------------------------

def results_module() -> ModuleType:
    """loadtests/tools/results.py, which writes the result files and holds their schema."""
    if "qkv_bench_results" not in sys.modules:
        spec = importlib.util.spec_from_file_location("qkv_bench_results", RESULTS_MODULE)
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["qkv_bench_results"]


def read_result(name: str, results_dir: Path = RESULTS) -> dict[str, Any]:
    path = results_dir / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in results_dir.glob("*.json"))) or "none"
        raise ValueError(f"docs marker 'generated: bench {name}': no {path}; result files: {known}")
    doc = json.loads(path.read_text())
    problems = results_module().problems(doc)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return doc


def bench_extra_table(name: str, part: str, results_dir: Path = RESULTS) -> str:
    """One of the more tables of `results_dir`/NAME.json (`tables.PART`), from the run the main table's
    provenance describes."""
    doc = read_result(name, results_dir)
    extra = doc.get("tables", {}).get(part)
    if extra is None:
        raise ValueError(f"docs marker 'generated: bench {name} {part}': {name}.json has no table {part!r}; "
                         f"it has {', '.join(doc.get('tables', {})) or 'none'}")
    return table(extra["columns"], [[format_cell(v) for v in row] for row in extra["rows"]])


def bench_table(name: str, results_dir: Path = RESULTS) -> str:
    """The table of `results_dir`/NAME.json and where its numbers came from."""
    doc = read_result(name, results_dir)
    rows = [[format_cell(v) for v in row] for row in doc["table"]["rows"]]
    return "\n\n".join(part for part in (doc.get("title") and f"**{doc['title']}**",
                                         table(doc["table"]["columns"], rows), provenance(doc)) if part)


def provenance(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    gpu = m["gpu"] or "no GPU"
    machine = (f"{m['cpu_model']}, {m['cores']} cores, copy {m['copy_bandwidth_gb_s']} GB/s, "
               f"float32 matmul {m['matmul_peak_gflops']} GFLOP/s, {gpu}")
    lines = [f"Command: `{doc['command']}`. Run {doc['date']} at commit `{doc['commit']}` on {machine}."]
    for key, label in (("source", "Source"), ("note", "Note")):
        if doc.get(key):
            lines.append(f"{label}: {doc[key]}")
    return "\n\n".join(lines)


def format_cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


# ---- markdown -------------------------------------------------------------------------------

def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(str(v)) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(text: str) -> str:
    """A table cell: pipes outside code spans escaped (Python-Markdown keeps them inside), one line."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))
