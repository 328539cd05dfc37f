"""The layering of model/ stays enforced, not just described.

- The torch-free modules import without torch (checked in a fresh interpreter, so whatever
  they pull in transitively counts).
- Nothing under model/ imports Ray, FastAPI, Starlette, Pydantic or the service package
  (every import statement, lazy ones inside functions included).
- The building blocks sit below what uses them: model.layers imports only model.config and
  itself; model.models and model.inspect only those and model.layers.
- service/'s parts the same way: service.engine (the step loop, gate, metrics) imports no other
  part; the HTTP edge (service.http, the API families and the tenants' keys and quotas) only
  service.engine; the replica's deployment and the routing, which both stand on the edge, not
  each other; service.launch nothing (it runs before Ray Serve is imported). The app on top (app.py, multi_model.py) may
  import any part.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "model"
SERVICE = REPO / "service"

TORCH_FREE = [
    "model.engine.sequence",
    "model.engine.block_manager",
    "model.engine.kv_share_layout",
    "model.engine.scheduler",
    "model.sampling.params",
    "model.sampling.request_checks",
    "model.inspect.attention_spec",
    "model.loading.pooling_config",  # the HTTP edge checks embedding requests with it
]
FORBIDDEN_IN_MODEL = {"ray", "fastapi", "starlette", "pydantic", "service"}
# Ray carries tensor parallelism's worker actors (issue 29): allowed there only, imported by the
# engine only when tensor_parallel_size > 1.
RAY_ALLOWED_IN = MODEL / "engine" / "parallel"
# sub-package -> the model.* parts it may import
ALLOWED_BELOW = {
    "layers": {"config", "layers"},
    "models": {"config", "layers", "models"},
    "inspect": {"config", "layers", "inspect"},
}

# service part -> the service parts it may import (a part: a sub-package, or a module at the top)
EDGE = {"engine", "http", "openai", "anthropic", "tools", "tenancy"}
SERVICE_ALLOWED = {
    "engine": {"engine"},
    "tools": {"tools"},  # tool-call parsing knows nothing of HTTP or the engine
    "http": EDGE, "openai": EDGE, "anthropic": EDGE, "tenancy": EDGE,
    "replica": EDGE | {"replica"},
    "routing": EDGE | {"routing"},
    "launch": set(),
}


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module of `package`; relative
    imports resolved."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            if base.split(".")[0] in ("model", "service"):  # `from model import layers` imports model.layers
                found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def package_imports(root: Path) -> list[tuple[Path, int, str]]:
    """(file, line, module) of every import in every file under `root`."""
    files = sorted(root.rglob("*.py"))
    assert len(files) > 30, f"{root.name}/ should hold the package's modules"
    return [(path, line, name) for path in files
            for line, name in imported_modules(path.read_text(), ".".join(path.relative_to(REPO).parts[:-1]))]


def model_imports() -> list[tuple[Path, int, str]]:
    return package_imports(MODEL)


def service_part(parts: tuple[str, ...] | list[str]) -> str | None:
    """The part of service/ that a module's dotted name below `service` falls in: its sub-package,
    or the module itself at the top (`app`, `launch`); None for the package itself."""
    return parts[0].removesuffix(".py") if parts and parts[0] != "__init__.py" else None


def service_layering_offences(imports: list[tuple[Path, int, str]]) -> list[str]:
    offences = []
    for path, line, name in imports:
        part = service_part(path.relative_to(SERVICE).parts)
        parts = name.split(".")
        if part in SERVICE_ALLOWED and parts[0] == "service" and len(parts) > 1 \
                and service_part(parts[1:]) not in SERVICE_ALLOWED[part]:
            offences.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return offences


def test_imported_modules_sees_every_kind_of_import() -> None:
    source = ("import ray.serve\nfrom . import kv_cache\nfrom ..models.gpt2 import GPT2\n\n"
              "def f():\n    from pydantic import BaseModel\n")
    names = {name for _, name in imported_modules(source, "model.layers")}
    assert {"ray.serve", "model.layers", "model.layers.kv_cache", "model.models.gpt2", "pydantic"} <= names


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"importing {module} imported torch"


def test_nothing_under_model_imports_ray_http_pydantic_or_service() -> None:
    offences = []
    for path, line, name in model_imports():
        top = name.split(".")[0]
        if top in FORBIDDEN_IN_MODEL and not (top == "ray" and RAY_ALLOWED_IN in path.parents):
            offences.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offences, "model/ must stay free of Ray, HTTP and Pydantic:\n" + "\n".join(offences)


def test_building_blocks_do_not_import_what_is_built_on_them() -> None:
    offences = []
    for path, line, name in model_imports():
        part = path.relative_to(MODEL).parts[0]
        parts = name.split(".")
        if part in ALLOWED_BELOW and parts[0] == "model" and len(parts) > 1 and parts[1] not in ALLOWED_BELOW[part]:
            offences.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not offences, "\n".join(offences)


def test_service_parts_import_only_the_parts_below_them() -> None:
    parts = {service_part(path.relative_to(SERVICE).parts) for path in SERVICE.rglob("*.py")}
    assert set(SERVICE_ALLOWED) <= parts, "a part named in SERVICE_ALLOWED is missing from service/"
    offences = service_layering_offences(package_imports(SERVICE))
    assert not offences, "service/ imports against its layering:\n" + "\n".join(offences)


def test_service_layering_catches_a_wrong_way_import() -> None:
    wrong = [(SERVICE / "engine" / "engine_loop.py", 1, "service.http.errors"),
             (SERVICE / "http" / "api.py", 2, "service.replica.engine_deployment"),
             (SERVICE / "routing" / "router.py", 3, "service.app"),
             (SERVICE / "replica" / "engine_deployment.py", 4, "service.routing.router"),
             (SERVICE / "launch.py", 5, "service.app")]
    right = [(SERVICE / "openai" / "serving.py", 6, "service.engine.engine_loop"),
             (SERVICE / "replica" / "engine_deployment.py", 7, "service.http.api"),
             (SERVICE / "app.py", 8, "service.routing.prefix_route")]
    offences = service_layering_offences(wrong + right)
    assert [int(offence.split(":")[1].split()[0]) for offence in offences] == [1, 2, 3, 4, 5], offences
