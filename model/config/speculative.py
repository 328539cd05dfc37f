"""`speculative_config`: {"method": "ngram", "num_speculative_tokens", "prompt_lookup_min",
"prompt_lookup_max"} or {"method": "draft_model", "model", "num_speculative_tokens"}; both take
"disable_by_batch_size". No torch here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from model.config.fields import REQUIRED, described

METHODS = ("ngram", "draft_model")
# Speculation is off for a step whose running batch is larger than this, per method: measured on
# the CPU with loadtests/benchmarks/bench_spec_decode.py --backoff (docs/features/speculative-decoding.md):
# the default model gained with ngram up to 3 running sequences, with its trained draft up to 8.
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 3, "draft_model": 8}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = described(REQUIRED, "`ngram` (proposals copied from earlier in the sequence) or `draft_model` "
                                      "(proposed by a small model).")
    num_speculative_tokens: int = described(REQUIRED, "Tokens proposed per step and verified in one forward pass of "
                                                      "the model.")
    prompt_lookup_min: int = described(1, "ngram: the shortest n-gram matched against the sequence.")
    prompt_lookup_max: int = described(4, "ngram: the longest n-gram matched (tried first, down to "
                                          "prompt_lookup_min).")
    model: str | None = described(None, "draft_model: the draft, a preset, checkpoint directory or hub id with the "
                                        "target's vocabulary; required for that method.")
    disable_by_batch_size: int | None = described(
        None, "Speculation is off for a step whose running batch is larger than this; None: "
              + ", ".join(f"{n} for {m}" for m, n in DEFAULT_DISABLE_BY_BATCH_SIZE.items()) + " (measured on the CPU).")

    @classmethod
    def parse(cls, raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Validated config with every default filled in, or None for no speculation; ValueError
        naming the bad key."""
        if raw is None:
            return None
        if isinstance(raw, SpeculativeConfig):
            raw = {f.name: getattr(raw, f.name) for f in fields(raw)}
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; got {method!r}")
        if raw.get("disable_by_batch_size") is None:
            raw = {**raw, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE[method]}
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = raw.get(name, getattr(cls, name, None))  # the class attribute: the field's default
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        cfg = cls(**raw)
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.method 'draft_model' needs 'model' (a preset or checkpoint)")
        if method == "ngram" and cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{cfg.prompt_lookup_min}, {cfg.prompt_lookup_max}")
        return cfg
