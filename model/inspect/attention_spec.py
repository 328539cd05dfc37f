"""What an attention request asks for, and the one check of it against a model. No torch here.

An attention request is an ordinary engine request (greedy, `max_tokens` tokens, at least one
so it is scheduled like any other) that carries an `AttentionSpec` in its `SamplingParams`.
When it finishes, the engine recomputes its tokens once more through the same layers with a
capture in the step metadata (`model.inspect.attention_maps`), and returns the weights with the output.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALES = ("sqrt_dk", "none")
ROW_KEYWORDS = ("all", "last")


class AttentionRequestError(ValueError):
    """A bad attention option; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AttentionShape:
    """The attention layout of a model, as the HTTP edge needs it to check a request."""

    kind: str  # "dot" | "additive"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    d_head: int

    @classmethod
    def of(cls, cfg: object) -> AttentionShape:
        """From a `ModelConfig`."""
        return cls(cfg.attention, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.d_head)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class AttentionSpec:
    """Which weights to return. `layers`/`heads` None: all; `rows`: "all", "last" or query
    positions in the prompt + generated tokens; `max_tokens`: greedy tokens generated first
    (their rows included); `scale`: "sqrt_dk" (the model's own scores) or "none" (the same
    q.k without 1/sqrt(d_k), dot-product models only)."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    rows: str | tuple[int, ...] = "all"
    max_tokens: int = 0
    scale: str = "sqrt_dk"

    def resolve_layers(self, shape: AttentionShape) -> list[int]:
        return list(range(shape.num_layers)) if self.layers is None else list(self.layers)

    def resolve_heads(self, shape: AttentionShape) -> list[int]:
        return list(range(shape.num_heads)) if self.heads is None else list(self.heads)

    def resolve_rows(self, num_tokens: int) -> list[int]:
        """Query positions among `num_tokens` tokens (positions past the end are dropped:
        generation may stop early)."""
        if self.rows == "all":
            return list(range(num_tokens))
        if self.rows == "last":
            return [num_tokens - 1]
        return [r for r in self.rows if r < num_tokens]


def _indices(name: str, values: tuple[int, ...] | None, bound: int) -> None:
    if values is None:
        return
    if not values:
        raise AttentionRequestError(f"{name} must not be empty (leave it out for all)", name)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < bound]
    if bad:
        raise AttentionRequestError(f"{name} must be indices in [0, {bound - 1}], got {bad[0]!r}", name)
    if len(set(values)) != len(values):
        raise AttentionRequestError(f"{name} must not repeat an index, got {list(values)}", name)


def check_attention(spec: AttentionSpec, shape: AttentionShape, num_prompt_tokens: int,
                    max_floats: int | None = None) -> int:
    """Raise `AttentionRequestError` (naming the field) unless `spec` fits the model and the
    prompt; returns the most floats the answer can hold. `max_floats` bounds that number."""
    if spec.scale not in SCALES:
        raise AttentionRequestError(f"scale must be one of {', '.join(SCALES)}, got {spec.scale!r}", "scale")
    if spec.scale == "none" and shape.kind != "dot":
        raise AttentionRequestError("scale 'none' applies to dot-product attention only; this model's "
                                    f"attention is {shape.kind}", "scale")
    if isinstance(spec.max_tokens, bool) or not isinstance(spec.max_tokens, int) or spec.max_tokens < 0:
        raise AttentionRequestError(f"max_tokens must be an integer >= 0, got {spec.max_tokens!r}", "max_tokens")
    _indices("layers", spec.layers, shape.num_layers)
    _indices("heads", spec.heads, shape.num_heads)
    total = num_prompt_tokens + spec.max_tokens
    if isinstance(spec.rows, str):
        if spec.rows not in ROW_KEYWORDS:
            raise AttentionRequestError(f"rows must be 'all', 'last' or a list of positions, got {spec.rows!r}",
                                        "rows")
    else:
        _indices("rows", spec.rows, total)
    floats = (len(spec.resolve_layers(shape)) * len(spec.resolve_heads(shape)) * len(spec.resolve_rows(total))
              * total)
    if max_floats is not None and floats > max_floats:
        raise AttentionRequestError(
            f"this request would return {floats} attention weights (layers x heads x rows x keys = "
            f"{len(spec.resolve_layers(shape))} x {len(spec.resolve_heads(shape))} x "
            f"{len(spec.resolve_rows(total))} x {total}); the server's limit is {max_floats} "
            "(app argument max_attention_floats): ask for fewer layers, heads or rows "
            "(e.g. rows: 'last'), or a shorter prompt", "layers")
    return floats
