"""The layering of model/, service/ and tests/ stays enforced, not just described.

- The allowed imports between parts are written once, as two tables (`MODEL_LAYERS`,
  `SERVICE_LAYERS`: part -> the parts it may import); each table is itself a ladder (no cycle),
  so an import the table allows never runs upward. Every import statement of every module counts,
  lazy ones inside functions included.
- No circle between modules anywhere in model/ and service/: the import graph of every module
  (lazy imports included) has no strongly connected component of two or more modules.
- The torch-free modules import without torch (in a fresh interpreter, so whatever they pull in
  transitively counts); nothing under model/ imports Ray (but tensor parallelism's workers),
  FastAPI, Starlette, Pydantic or the service package.
- tests/ mirrors the source: a test file under tests/model/<part>/ or tests/service/<part>/
  imports that part, tests/e2e/ holds the tests that start servers, and the helpers are imported
  one way (`tests.support.<module>`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.support.paths import REPO

MODEL = REPO / "model"
SERVICE = REPO / "service"
TESTS = REPO / "tests"

# part -> the parts it may import (itself always). A part is a sub-package or a module at the top.
MODEL_LAYERS: dict[str, set[str]] = {
    "config": set(),
    "sampling": {"config"},
    "layers": {"config"},
    "models": {"config", "layers"},
    "multimodal": {"config"},
    "inspect": {"config", "layers"},
    "loading": {"config", "sampling", "layers", "models"},
    "engine": {"config", "sampling", "layers", "models", "multimodal", "inspect", "loading"},
    "training": {"config", "layers", "models", "loading"},
    "llm": {"config", "sampling", "multimodal", "inspect", "loading", "engine"},
    "__init__": {"config", "sampling", "llm"},  # `from model import LLM, SamplingParams`, lazily
}
SERVICE_LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "tools": set(),  # tool-call parsing knows nothing of HTTP or the engine
    "autoscaling": set(),  # Serve pickles it by value into its controller: it imports nothing of the project
    "launch": set(),  # runs before Ray Serve is imported
    "engine": set(),
    "tenancy": {"errors"},
    "batch": {"errors", "tenancy"},  # files and batches on disk, their routes and the loop that runs them
    "http": {"errors", "engine", "tenancy"},
    "openai": {"errors", "tools", "engine", "tenancy", "http"},
    "anthropic": {"errors", "tools", "engine", "tenancy", "http", "openai"},
    "explorer": {"errors", "engine", "http", "openai"},
    # the Ray Data processor renders chat as the OpenAI family does; a batch job runs the replica's edge
    "offline": {"errors", "engine", "tenancy", "http", "openai", "server", "host", "batch"},
    "server": {"errors", "tools", "engine", "tenancy", "http", "openai", "anthropic", "explorer", "batch"},
    "host": {"engine", "autoscaling"},
    "replica": {"errors", "autoscaling", "engine", "tenancy", "http", "openai", "server", "host", "offline"},
    "routing": {"errors", "engine", "http", "openai"},
    "app": {"errors", "tools", "autoscaling", "launch", "engine", "tenancy", "http", "openai", "anthropic",
            "explorer", "server", "host", "replica", "routing", "batch"},
    "__init__": set(),
}
LAYERS = {"model": MODEL_LAYERS, "service": SERVICE_LAYERS}

TORCH_FREE = [
    "model.config",
    "model.engine.sequence",
    "model.engine.kv.block_manager",
    "model.engine.kv.events",
    "model.engine.kv.share_layout",
    "model.engine.scheduler",
    "model.sampling.params",
    "model.sampling.logprobs",
    "model.sampling.request_checks",
    "model.inspect.attention_spec",
    "model.loading.pooling_config",  # the HTTP edge checks embedding requests with it
    "service.autoscaling",
]
FORBIDDEN_IN_MODEL = {"ray", "fastapi", "starlette", "pydantic", "service"}
# Ray carries tensor parallelism's worker actors: allowed there only, imported by the engine only
# when tensor_parallel_size > 1.
RAY_ALLOWED_IN = MODEL / "engine" / "parallel"

# What an end-to-end test starts: Ray (Serve), a server process, a browser or Locust.
E2E_MARKERS = ("ray", "tests.support.local_serve", "tests.support.serve_fixtures", "tests.support.prom_server",
               "subprocess", "playwright", "locust")


# ---- the import graph ---------------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules(roots: Iterable[Path] = (MODEL, SERVICE)) -> dict[str, Path]:
    return {module_name(path): path for root in roots for path in sorted(root.rglob("*.py"))}


def imported_modules(source: str, module: str, is_package: bool, known: set[str] | None = None
                     ) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `module`, lazy ones included; relative
    imports resolved. `from a import b` names `a.b` when that is a module of `known`, else `a`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            if known is None:  # no module list: both readings, the package and each name below it
                found.append((node.lineno, base))
                if base.split(".")[0] in ("model", "service"):
                    found.extend((node.lineno, sub) for sub in subs)
            else:
                modules = [sub for sub in subs if sub in known]
                found.extend((node.lineno, sub) for sub in modules)
                if len(modules) < len(subs):
                    found.append((node.lineno, base))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, list[tuple[int, str]]]:
    """module -> (line, project module it imports), the imported name cut back to a known module."""
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        edges = []
        for line, imported in imported_modules(path.read_text(), name, path.name == "__init__.py", known):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.append((line, imported))
        graph[name] = edges
    return graph


def circles(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of two or more nodes (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def part_of(module: str) -> tuple[str, str] | None:
    """(package, part) of a model/service module: its sub-package or top-level module."""
    parts = module.split(".")
    if parts[0] not in LAYERS:
        return None
    return parts[0], parts[1] if len(parts) > 1 else "__init__"


def layering_offences(graph: dict[str, list[tuple[int, str]]], modules: dict[str, Path]) -> list[str]:
    offences = []
    for name, edges in graph.items():
        here = part_of(name)
        for line, imported in edges:
            there = part_of(imported)
            if here is None or there is None or there[0] != here[0] or there[1] == here[1]:
                continue  # service -> model is the one way between the packages (checked below)
            if there[1] not in LAYERS[here[0]].get(here[1], set()):
                offences.append(f"{modules[name].relative_to(REPO)}:{line} imports {imported} "
                                f"({here[0]}.{here[1]} may import only {sorted(LAYERS[here[0]].get(here[1], set()))})")
    return offences


# ---- the tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_table_is_a_ladder(package: str) -> None:
    """No cycle in the table itself, so no pair of parts may import each other, even by two hops."""
    table = LAYERS[package]
    assert not circles({part: sorted(below & set(table)) for part, below in table.items()})


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_every_part_is_in_its_table(package: str) -> None:
    root = REPO / package
    parts = {p.stem if p.is_file() else p.name for p in root.iterdir()
             if (p.is_dir() and any(p.rglob("*.py"))) or p.suffix == ".py"}
    parts.discard("weights")  # data, no code
    assert parts == set(LAYERS[package]), f"{package}/'s parts and its table differ: {parts ^ set(LAYERS[package])}"


# ---- the code against the tables ----------------------------------------------------------------

def test_no_import_runs_against_the_tables() -> None:
    modules = source_modules()
    offences = layering_offences(import_graph(modules), modules)
    assert not offences, "imports against the layering:\n" + "\n".join(offences)


def test_no_circle_between_modules() -> None:
    found = circles({name: [m for _, m in edges] for name, edges in import_graph(source_modules()).items()})
    assert not found, f"import circles: {found}"


def test_model_never_imports_service_ray_http_or_pydantic() -> None:
    offences = []
    for name, path in source_modules([MODEL]).items():
        for line, imported in imported_modules(path.read_text(), name, path.name == "__init__.py"):
            top = imported.split(".")[0]
            if top in FORBIDDEN_IN_MODEL and not (top == "ray" and RAY_ALLOWED_IN in path.parents):
                offences.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    assert not offences, "model/ must stay free of Ray, HTTP and Pydantic:\n" + "\n".join(offences)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {module} imported torch"


# ---- the checker catches what it should ---------------------------------------------------------

def test_imported_modules_sees_every_kind_of_import() -> None:
    source = ("import ray.serve\nfrom . import kv_cache\nfrom ..models.gpt2 import GPT2\n\n"
              "def f():\n    from pydantic import BaseModel\n")
    names = {name for _, name in imported_modules(source, "model.layers.attention", False)}
    assert {"ray.serve", "model.layers", "model.layers.kv_cache", "model.models.gpt2", "pydantic"} <= names
    known = {"model.layers.kv_cache", "model.models.gpt2"}
    precise = {name for _, name in imported_modules(source, "model.layers.attention", False, known)}
    assert {"model.layers.kv_cache", "model.models.gpt2"} <= precise and "model.layers" not in precise


def test_the_checks_catch_a_wrong_way_import_and_a_circle() -> None:
    modules = {name: REPO / "x.py" for name in ("model.sampling.sampler", "model.engine.sequence",
                                                "service.http.api", "service.openai.serving", "service.app",
                                                "service.errors", "service.tenancy.keys")}
    graph = {"model.sampling.sampler": [(1, "model.engine.sequence")],  # upward
             "model.engine.sequence": [(2, "model.sampling.sampler")],  # allowed, and closes a circle
             "service.http.api": [(3, "service.openai.serving")],  # the edge importing a family
             "service.openai.serving": [(4, "service.http.api")],  # allowed
             "service.errors": [(5, "service.tenancy.keys")],  # the bottom importing a part
             "service.tenancy.keys": [(6, "service.errors")]}  # allowed
    offences = layering_offences(graph, modules)
    assert [int(o.split(":")[1].split()[0]) for o in offences] == [1, 3, 5], offences
    assert circles({k: [m for _, m in v] for k, v in graph.items()}) == [
        ["model.engine.sequence", "model.sampling.sampler"], ["service.http.api", "service.openai.serving"],
        ["service.errors", "service.tenancy.keys"]]


# ---- tests/ mirrors the source ------------------------------------------------------------------

def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if p.parent != TESTS)


def imports_of_test(path: Path, known: set[str]) -> set[str]:
    """What a test file imports, and what the tests/support helpers it imports import."""
    imported = {name for _, name in imported_modules(path.read_text(), module_name(path), False, known)}
    for helper in [name for name in imported if name.startswith("tests.support.")]:
        helper_path = REPO / (helper.replace(".", "/") + ".py")
        if helper_path.is_file():
            imported |= {name for _, name in imported_modules(helper_path.read_text(), helper, False, known)}
    return imported


def test_tests_live_in_the_folder_of_what_they_test() -> None:
    """tests/<package>/<part>/ imports <package>.<part> (itself or through a tests/support helper);
    tests/<package>/ (the package's top-level modules) imports one; tests/e2e/ starts something
    (Ray, a server process, a browser, Locust)."""
    known = set(source_modules())
    offences = []
    for path in _test_files():
        rel = path.relative_to(TESTS).parts
        source = path.read_text()
        imported = imports_of_test(path, known)
        if rel[0] in LAYERS:
            want = ".".join(rel[:2]) if len(rel) > 2 else rel[0]
            if not any(name == want or name.startswith(want + ".") for name in imported):
                offences.append(f"{path.relative_to(REPO)} imports nothing of {want}")
        elif rel[0] == "e2e":
            if not any(name.split(".")[0] in E2E_MARKERS or name.startswith(E2E_MARKERS) for name in imported) \
                    and "shared_serve" not in source:
                offences.append(f"{path.relative_to(REPO)} starts nothing (no Ray, server, browser or Locust)")
        elif rel[0] not in ("gpu", "docs", "loadtests"):
            offences.append(f"{path.relative_to(REPO)} is in no folder of the source")
    assert not offences, "\n".join(offences)


def test_only_the_layering_test_sits_at_the_top_of_tests() -> None:
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == ["test_layering.py"]


def test_helpers_are_imported_one_way() -> None:
    """A helper module of tests/support (or another test module) is imported by its package,
    `tests.support.<name>`, never bare through sys.path."""
    helpers = {p.stem for p in (TESTS / "support").glob("*.py")} - {"__init__"}
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        for line, name in imported_modules(path.read_text(), module_name(path), path.name == "__init__.py"):
            if name.split(".")[0] in helpers or name.startswith("test_"):
                offences.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offences, "import helpers as tests.support.<name>:\n" + "\n".join(offences)
