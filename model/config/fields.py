"""A configuration field that carries its user-facing description."""

from __future__ import annotations

import dataclasses
from typing import Any

REQUIRED: Any = dataclasses.MISSING  # the default of a `described` field that has none


def described(default: object, description: str) -> Any:
    """A dataclass field and what it means to a user: the argument reference in docs/ is generated
    from the description, and `service.app.AppArgs` takes default and description from here."""
    return dataclasses.field(default=default, metadata={"description": description})
