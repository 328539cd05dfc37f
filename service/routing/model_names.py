"""Which served model of a multi-model app a request's `model` names: a served name, one of a
model's LoRA adapters, or `<served>:<adapter>` for a model that loads adapters by name. Known when
the app is built (from the arguments), so the router that HAProxy asks and the multi-model front
resolve names the same way without asking an engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ServedModel:
    """One model of the app: its served name, its start-up adapters, whether it loads adapters by name."""

    name: str
    adapters: tuple[str, ...] = ()
    lora_dynamic: bool = False


class ModelNames:
    """The app's served models in order; the first one answers requests that name none."""

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("a multi-model app serves at least one model")
        self.models = list(models)
        self.names = [m.name for m in models]

    def target(self, model: str | None) -> str | None:
        """The served model that answers `model` (no model: the first); None: not served here."""
        if model is None:
            return self.names[0]
        for m in self.models:
            if model == m.name or model in m.adapters:
                return m.name
        base, sep, adapter = model.partition(":")
        for m in self.models:
            if m.lora_dynamic and sep and adapter and base == m.name:
                return m.name
        return None


class Unreadable:
    """A body whose `model` cannot be read (not JSON, not an object): any replica answers its error."""


UNREADABLE = Unreadable()


def body_model(body: bytes) -> str | None | Unreadable:
    """The `model` field of a JSON request body: a string, None when absent (or not a string: the
    edge answers that with a 400), `UNREADABLE` when the body is not a JSON object."""
    try:
        parsed = json.loads(body) if body else {}
    except ValueError:
        return UNREADABLE
    if not isinstance(parsed, dict):
        return UNREADABLE
    model = parsed.get("model")
    return model if isinstance(model, str) else None
