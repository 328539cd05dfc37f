"""`speculative_config`: {"method": "ngram", "num_speculative_tokens", "prompt_lookup_min",
"prompt_lookup_max"} or {"method": "draft_model", "model", "num_speculative_tokens"}; both take
"disable_by_batch_size". No torch here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# Speculation is off for a step whose running batch is larger than this (measured on the CPU with
# loadtests/bench_spec_decode.py --backoff; see the README's speculative-decoding section).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Validated config, or None for no speculation; ValueError naming the bad key."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; got {method!r}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        cfg = cls(**raw)
        if method == "draft_model" and not cfg.model:
            raise ValueError("speculative_config.method 'draft_model' needs 'model' (a preset or checkpoint)")
        if method == "ngram" and not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{cfg.prompt_lookup_min}, {cfg.prompt_lookup_max}")
        if cfg.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {cfg.disable_by_batch_size}")
        return cfg
