"""docs/generate.py (a script, not a package module) loaded once for the docs tests."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support.paths import REPO

MODULE_NAME = "qkv_docs_generate"


def load_generate() -> ModuleType:
    if MODULE_NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE_NAME, REPO / "docs" / "generate.py")
        sys.modules[MODULE_NAME] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[MODULE_NAME])
    return sys.modules[MODULE_NAME]
