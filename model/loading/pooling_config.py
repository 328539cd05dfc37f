"""How a checkpoint turns hidden states into one embedding: sentence-transformers' `modules.json`
(Transformer, Pooling, Normalize) and `1_Pooling/config.json`, plus the Matryoshka flags of
`config.json` (`matryoshka_dimensions`, `is_matryoshka`) that let a request ask for fewer
`dimensions`. Torch-free: the HTTP edge checks requests against it too.

Without `modules.json` the default is sentence-transformers' own for a plain transformers
checkpoint (6.x): last-token pooling when `architectures[0]` ends in `ForCausalLM` (and
`is_causal` is not false), mean pooling otherwise, never normalized; so `SentenceTransformer(dir)`
and this server agree. The presets are causal LMs: last token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.sampling.request_checks import RequestError, check_token_ids

POOLING_MODES = ("lasttoken", "mean", "cls", "max")  # sentence-transformers' names
MODULES_FILE = "modules.json"
_MODE_KEYS = {f"pooling_mode_{m}" if m == "lasttoken" else f"pooling_mode_{m}_tokens": m
              for m in ("mean", "max", "lasttoken")} | {"pooling_mode_cls_token": "cls"}
_UNSUPPORTED_MODE_KEYS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    """`mode`: one of POOLING_MODES; `normalize`: L2-normalize the pooled vector; `dimensions`:
    the full embedding size; `matryoshka`: None when `dimensions` may not be lowered, () when any
    smaller size may be asked for, else the sizes allowed; `unsupported`: why this checkpoint
    cannot embed (a sentence-transformers module we do not run), None when it can."""

    mode: str
    normalize: bool
    dimensions: int
    matryoshka: tuple[int, ...] | None = None
    source: str = "default"  # "sentence-transformers" when modules.json said so
    unsupported: str | None = None

    def check_dimensions(self, dimensions: int | None) -> int:
        """The embedding size a request gets; RequestError(param="dimensions") when it may not."""
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        if dimensions < 1 or dimensions > self.dimensions:
            raise RequestError(f"dimensions must be between 1 and the model's {self.dimensions}, got {dimensions}",
                               "dimensions")
        if self.matryoshka is None:
            raise RequestError(f"this model does not support dimensions other than its {self.dimensions} "
                               "(its config.json declares no matryoshka_dimensions)", "dimensions")
        if self.matryoshka and dimensions not in self.matryoshka:
            raise RequestError(f"dimensions must be one of {', '.join(map(str, self.matryoshka))}, got {dimensions}",
                               "dimensions")
        return dimensions


def _json(path: Path) -> Any:
    return json.loads(path.read_text("utf-8"))


def _matryoshka(raw: dict[str, Any], hidden: int) -> tuple[int, ...] | None:
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(sorted({int(d) for d in dims if 1 <= int(d) <= hidden}))
    return () if raw.get("is_matryoshka") else None


def _pooling_mode(config: dict[str, Any]) -> str | None:
    """The one mode a `1_Pooling/config.json` switches on (its `pooling_mode` string in newer files)."""
    named = config.get("pooling_mode")
    if isinstance(named, list) and len(named) == 1:  # sentence-transformers 6 also writes a list
        named = named[0]
    if isinstance(named, str):
        return named if named in POOLING_MODES else None
    if named is not None:  # several modes, concatenated by sentence-transformers
        return None
    modes = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if len(modes) != 1 or any(config.get(k) for k in _UNSUPPORTED_MODE_KEYS):
        return None
    return modes[0]


def read_pooling_config(directory: str | Path | None, hidden_size: int) -> PoolingConfig:
    """The pooling of a checkpoint directory (None: a preset, which has the default). A file
    that cannot be read leaves the model serving generation, with embeddings `unsupported`."""
    if directory is None:
        return PoolingConfig("lasttoken", False, hidden_size)
    try:
        return _read(Path(directory), hidden_size)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return PoolingConfig("mean", False, hidden_size, unsupported=f"its pooling files cannot be read "
                                                                     f"({type(exc).__name__})")


def _default_mode(raw: dict[str, Any]) -> str:
    """sentence-transformers' pooling for a checkpoint without modules.json."""
    archs = raw.get("architectures") or [""]
    causal = str(archs[0]).endswith("ForCausalLM") and raw.get("is_causal", True) is not False
    return "lasttoken" if causal else "mean"


def _read(directory: Path, hidden_size: int) -> PoolingConfig:
    config_file = directory / "config.json"
    raw = _json(config_file) if config_file.is_file() else {}
    matryoshka = _matryoshka(raw, hidden_size)
    modules_file = directory / MODULES_FILE
    if not modules_file.is_file():
        return PoolingConfig(_default_mode(raw), False, hidden_size, matryoshka)
    mode, normalize, unsupported = "mean", False, None
    for module in sorted(_json(modules_file), key=lambda m: m.get("idx", 0)):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]  # models.Pooling, or 6.x: ...modules.Pooling
        if kind == "Transformer" and module.get("path", "") in ("", "."):
            continue
        if kind == "Pooling":
            found = _pooling_mode(_json(directory / module["path"] / "config.json"))
            if found is None:
                unsupported = (f"its {module['path']}/config.json asks for a pooling mode other than "
                               f"one of {', '.join(POOLING_MODES)}")
            mode = found or mode
        elif kind == "Normalize":
            normalize = True
        else:
            unsupported = (f"its sentence-transformers module {module.get('type')!r} ({module.get('path')}) is "
                           "not run by this server (supported: Transformer at the top level, Pooling, Normalize)")
    return PoolingConfig(mode, normalize, hidden_size, matryoshka, "sentence-transformers", unsupported)


def check_embedding_inputs(prompts: list[list[int]], vocab_size: int, max_model_len: int, max_inputs: int,
                           param: str = "input") -> None:
    """An embedding request's token-id prompts: 1..max_inputs of them, each non-empty, in the
    vocabulary and within the context. RequestError naming `param` (and the input's index)."""
    if not prompts:
        raise RequestError(f"{param} must not be empty: give a string, a list of strings or token ids", param)
    if len(prompts) > max_inputs:
        raise RequestError(f"{param} may hold at most {max_inputs} inputs, got {len(prompts)}", param)
    for i, ids in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}[{i}]"
        try:
            check_token_ids(ids, vocab_size, where)  # the generation routes' check
        except RequestError as exc:
            raise RequestError(str(exc), param) from None
        if len(ids) > max_model_len:
            raise RequestError(f"{where} has {len(ids)} tokens; this model's maximum context length is "
                               f"{max_model_len} tokens", param, "context_length_exceeded")
