"""The layering of model/ stays enforced, not just described.

- The torch-free modules import without torch (checked in a fresh interpreter, so whatever
  they pull in transitively counts).
- Nothing under model/ imports Ray, FastAPI, Starlette, Pydantic or the service package
  (every import statement, lazy ones inside functions included).
- The building blocks sit below what uses them: model.layers imports only model.config and
  itself; model.models and model.inspect only those and model.layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "model"

TORCH_FREE = [
    "model.engine.sequence",
    "model.engine.block_manager",
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


def model_imports() -> list[tuple[Path, int, str]]:
    """(file, line, module) of every import in every file under model/."""
    files = sorted(MODEL.rglob("*.py"))
    assert len(files) > 30, "model/ should hold the package's modules"
    return [(path, line, name) for path in files
            for line, name in imported_modules(path.read_text(), ".".join(path.relative_to(REPO).parts[:-1]))]


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
