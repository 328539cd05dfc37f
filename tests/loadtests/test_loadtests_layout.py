"""loadtests/ keeps its commands apart from what they share (CONVENTIONS 24).

- A script (every module under loadtests/ but loadtests/lib/ and the packages' __init__) is a
  command: no module of the repository imports it, at the top or lazily inside a function, by
  its dotted name, by its bare name (a script's folder is on sys.path when it runs), through
  importlib, or by file path (spec_from_file_location, runpy.run_path). Running one as a
  subprocess is how a test uses it.
- What two scripts share lives in loadtests/lib, which imports no script and holds no command
  (no `if __name__ == "__main__":`); every script has one (the locustfile, which Locust loads,
  excepted).
- Every file under loadtests/ byte-compiles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO

LOADTESTS = REPO / "loadtests"
LIB = LOADTESTS / "lib"
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "site", "build", "__pycache__"}
# Commands that another program loads rather than `python script.py` runs.
COMMANDS_WITHOUT_MAIN = {"loadtests/locustfile.py": "Locust loads it: `locust -f loadtests/locustfile.py`"}
PATH_LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader", "load_source"}


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def scripts() -> dict[str, Path]:
    """Each script's dotted module name -> its file."""
    return {".".join(p.relative_to(REPO).with_suffix("").parts): p for p in sorted(LOADTESTS.rglob("*.py"))
            if p.name != "__init__.py" and LIB not in p.parents and "__pycache__" not in p.parts}


def repository_modules() -> list[Path]:
    """Every Python file of the repository (the virtual environment and build outputs aside)."""
    out = []
    for path in sorted(REPO.rglob("*.py")):
        parts = set(path.relative_to(REPO).parts[:-1])
        if not parts & SKIPPED_DIRS and not any(p.startswith(".") for p in parts):
            out.append(path)
    return out


def package_of(path: Path, root: Path = REPO) -> list[str]:
    return list(path.relative_to(root).parent.parts)


def imported_names(source: str, path: Path, root: Path = REPO) -> set[str]:
    """The dotted names a module imports anywhere in it (lazy imports included): `import a.b`
    gives a.b, `from a import b` gives a and a.b, relative imports resolved against the module's
    package, `importlib.import_module("a.b")` gives a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = package_of(path, root)
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            if base:
                names.add(base)
            names |= {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
        elif isinstance(node, ast.Call) and _called(node) == "import_module":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return names


def loaded_paths(source: str, path: Path) -> set[str]:
    """The loadtests/ files a module loads by path (spec_from_file_location, runpy.run_path...),
    from the string constants of the call's arguments and of the module-level names they use."""
    tree = ast.parse(source, str(path))
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in PATH_LOADERS:
            found = _path_in(_strings(node, assigned))
            if found:
                out.add(found)
    return out


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _strings(node: ast.AST, assigned: dict[str, ast.AST], depth: int = 0) -> list[str]:
    """The string constants under `node` in source order (`ROOT / "loadtests" / "x.py"`), a
    module-level name replaced by what it was assigned."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.Name):
        return _strings(assigned[node.id], assigned, depth + 1) if node.id in assigned and depth < 3 else []
    return [s for child in ast.iter_child_nodes(node) for s in _strings(child, assigned, depth)]


def _path_in(strings: list[str]) -> str | None:
    parts = [p for s in strings for p in s.split("/") if p]
    if "loadtests" not in parts:
        return None
    start = parts.index("loadtests")
    end = next((i for i in range(start, len(parts)) if parts[i].endswith(".py")), None)
    return "/".join(parts[start:end + 1]) if end is not None else None


def script_imports() -> list[str]:
    """Every place a module imports a script, as 'importer: script'."""
    by_name = scripts()
    stems = {p.stem: name for name, p in by_name.items()}
    by_path = {rel(p): name for name, p in by_name.items()}
    found = []
    for path in repository_modules():
        source = path.read_text()
        for name in imported_names(source, path):
            target = name if name in by_name else stems.get(name) if "." not in name else None
            if target is not None and by_name[target] != path:
                found.append(f"{rel(path)}: {name} ({rel(by_name[target])})")
        found += [f"{rel(path)}: loads {p} by path" for p in loaded_paths(source, path) if p in by_path]
    return sorted(set(found))


def test_no_module_imports_a_script() -> None:
    found = script_imports()
    assert not found, ("a script is a command, never a library: move what is shared into loadtests/lib "
                       "(or run the script as a subprocess):\n" + "\n".join(found))


def test_lib_imports_no_script_and_holds_no_command() -> None:
    modules = sorted(LIB.glob("*.py"))
    assert LIB / "__init__.py" in modules and len(modules) > 1
    for path in modules:
        source = path.read_text()
        outside = sorted(n for n in imported_names(source, path)
                         if n.split(".")[0] == "loadtests" and not n.startswith("loadtests.lib") and n != "loadtests")
        assert not outside, f"{rel(path)} imports {outside}: loadtests/lib imports only loadtests.lib"
        assert not _has_main(source), f"{rel(path)} is a command: commands live beside loadtests/lib, not in it"


def test_every_script_is_a_command() -> None:
    without = sorted(rel(p) for p in scripts().values()
                     if not _has_main(p.read_text()) and rel(p) not in COMMANDS_WITHOUT_MAIN)
    assert not without, f"no `if __name__ == \"__main__\":` (a library belongs in loadtests/lib): {without}"
    missing = sorted(set(COMMANDS_WITHOUT_MAIN) - {rel(p) for p in scripts().values()})
    assert not missing, f"COMMANDS_WITHOUT_MAIN names files that are gone: {missing}"


@pytest.mark.parametrize("path", sorted(LOADTESTS.rglob("*.py")), ids=rel)
def test_every_file_byte_compiles(path: Path) -> None:
    compile(path.read_text(), str(path), "exec")


def _has_main(source: str) -> bool:
    for node in ast.parse(source).body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)):
            return True
    return False


# ---- the checks above can fail ----------------------------------------------------------------

def test_the_scan_sees_every_way_of_importing(tmp_path: Path) -> None:
    path = tmp_path / "loadtests" / "benchmarks" / "bench_x.py"
    source = '''
import loadtests.benchmarks.bench_engine
from loadtests.profilers import profile_step as ps

def lazy():
    from loadtests.tools.load_report import parse_args
    from .bench_quant import run_shape
    from . import bench_lora
    import importlib
    importlib.import_module("loadtests.benchmarks.bench_kv_share")
'''
    names = imported_names(source, path, root=tmp_path)
    assert {"loadtests.benchmarks.bench_engine", "loadtests.profilers.profile_step", "loadtests.tools.load_report",
            "loadtests.benchmarks.bench_quant", "loadtests.benchmarks.bench_lora",
            "loadtests.benchmarks.bench_kv_share"} <= names


def test_the_scan_sees_a_script_loaded_by_path(tmp_path: Path) -> None:
    source = '''
import importlib.util
ROOT = Path(__file__).parent
SCRIPT = ROOT / "loadtests" / "tools" / "device_check.py"
spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
other = importlib.util.spec_from_file_location("x", "loadtests/benchmarks/bench_engine.py")
runpy.run_path(str(ROOT / "loadtests/lib/results.py"))
'''
    assert loaded_paths(source, tmp_path / "t.py") == {
        "loadtests/tools/device_check.py", "loadtests/benchmarks/bench_engine.py", "loadtests/lib/results.py"}
    assert _has_main('if __name__ == "__main__":\n    main()\n') and not _has_main("def main(): pass\n")
