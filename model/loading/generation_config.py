"""A checkpoint's `generation_config.json`: the ids that end generation and the sampling defaults.

Read as vLLM reads it by default (`--generation-config auto`):
- `eos_token_id`, an int or a list: every id ends generation (Llama 3 instruct lists
  `<|end_of_text|>` and `<|eot_id|>`). When the file does not give it, `config.json`'s
  `eos_token_id` is used, as `transformers.GenerationConfig.from_model_config` does.
- `temperature`, `top_p`, `top_k`, `repetition_penalty`: defaults for requests that do not set
  them. Other keys (`do_sample`, `max_new_tokens`, ...) are not applied.

No torch: the HTTP edge applies the defaults too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """What `generation_config.json` (or `config.json`) says about generating."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)  # names of SamplingParams fields

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """`SamplingParams()` with the checkpoint's defaults, then `overrides`, applied."""
        return SamplingParams(**(self.sampling_defaults | overrides))

    def apply_defaults(self, params: SamplingParams, explicit: set[str]) -> SamplingParams:
        """`params` with the checkpoint's defaults in every field the caller did not set
        (`explicit` names the fields the caller did set)."""
        missing = {k: v for k, v in self.sampling_defaults.items() if k not in explicit}
        return dataclasses.replace(params, **missing) if missing else params


def _ids(value: Any) -> tuple[int, ...]:
    """An id or a list of ids (anything else: none), in order, without repeats."""
    values = value if isinstance(value, list) else [value]
    ids = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return tuple(dict.fromkeys(ids))


def _read(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _valid_defaults(raw: dict[str, Any], file: Path) -> dict[str, float | int]:
    """The sampling defaults that `SamplingParams` accepts; a bad one is dropped with a warning
    (it must not turn every request that omits the field into an error)."""
    defaults: dict[str, float | int] = {}
    for name in SAMPLING_DEFAULT_FIELDS:
        if raw.get(name) is None:
            continue
        try:
            SamplingParams(**{name: raw[name]})
        except ValueError as e:
            logger.warning("%s: ignoring %s: %s", file, name, e)
            continue
        defaults[name] = raw[name]
    return defaults


def load_generation_config(directory: str | Path | None) -> GenerationConfig:
    """The generation config of a checkpoint directory (empty for None or a directory with
    neither file)."""
    if directory is None:
        return GenerationConfig()
    directory = Path(directory)
    file = directory / GENERATION_CONFIG_FILE
    raw = _read(file)
    # Ids the file does not give come from the model config, as transformers derives them.
    model_raw = _read(directory / "config.json")
    eos = raw.get("eos_token_id", model_raw.get("eos_token_id"))
    bos = raw.get("bos_token_id", model_raw.get("bos_token_id"))
    return GenerationConfig(_ids(eos), _first(bos), _valid_defaults(raw, file))


def _first(value: Any) -> int | None:
    ids = _ids(value)
    return ids[0] if ids else None
