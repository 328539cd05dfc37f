"""What a test needs that the machine may lack: skipped on a developer's machine without it,
a failure under CI (`CI` set), where everything the suite needs is installed and built, so a
broken install or a kernel that no longer compiles cannot pass as a skip."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def in_ci() -> bool:
    """True under CI, where a missing tool, package or kernel is a failure, not a skip."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def required(available: bool, what: str) -> None:
    """Skip the calling test when `available` is false (`what` says what is missing); fail it under CI."""
    if not available:
        if in_ci():
            pytest.fail(f"{what} (required under CI)")
        pytest.skip(what)


def need_module(name: str) -> ModuleType:
    """`pytest.importorskip` outside CI; under CI a plain import, so a missing package fails."""
    if in_ci():
        return importlib.import_module(name)
    return pytest.importorskip(name)
