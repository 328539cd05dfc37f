"""The exception a tensor-parallel engine raises when one of its workers is gone."""

from __future__ import annotations


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died, or a step's collective timed out: the engine cannot go on.

    Raised by `Engine.check_health()` and `Engine.step()`; the replica holding the engine should be
    replaced as a whole (its workers' process group cannot take a new member)."""
