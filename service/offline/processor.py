"""A Ray Data processor for offline generation jobs, in the style of Ray's `ray.data.llm.build_processor`:
a `ray.data.Dataset` of rows in, the same rows with generated text out.

    processor = build_processor(ProcessorConfig(model="transformer-base-trained", concurrency=2))
    rows = processor(ray.data.from_items([{"prompt": "The cat"}])).take_all()

Each engine is an actor of a fixed pool (`concurrency`); Ray Data hands an actor `batch_size` rows
at a time and the actor gives them to its engine all at once, which runs them with continuous
batching. A row (after `preprocess`) holds `prompt` (text, or a list of token ids) or `messages`
(OpenAI chat messages, rendered with the model's chat template as the HTTP API renders them), and
optionally `sampling_params` (`SamplingParams` fields by name; those not given take the model's
defaults from its `generation_config.json`, as on the HTTP API). The answered row is that row plus
`OUTPUT_FIELDS`, then `postprocess` is applied to it.

Between stages Ray Data keeps rows in Arrow tables, where the dicts of one column share one set of
keys (a key another row has is None in this one): a `sampling_params` key set to None counts as not
given. A batch with a row that cannot run (no prompt nor messages, an unknown or bad sampling
parameter, a prompt the model cannot take) raises a ValueError naming each such row and what is
wrong with it before anything of the batch runs; Ray Data then fails the job with that message.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
from pydantic import ValidationError

from model.config import EngineConfig
from model.llm import ENGINE_FIELDS, LLM, CompletionOutput
from model.sampling.params import SamplingParams
from model.sampling.request_checks import check_request
from model.sampling.structured import check_structured
from service.errors import APIError, from_validation_error
from service.openai.chat_template import ChatTemplate
from service.openai.protocol import ChatMessage

logger = logging.getLogger(__name__)

Row = dict[str, Any]
RowFn = Callable[[Row], Row]

# The columns an answered row gains.
OUTPUT_FIELDS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens", "finish_reason")
# Fields an answered row has no column for: refused by name rather than computed and dropped.
UNANSWERED_FIELDS = frozenset({"logprobs", "prompt_logprobs"})
# What a row's sampling_params may set: the SamplingParams fields but those and the attention explorer's request.
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - UNANSWERED_FIELDS - {"attention"}
_MAX_LISTED = 5  # bad rows named in one error
_ROW_CHARS = 160  # of a bad row shown in the error


@dataclass(frozen=True)
class ProcessorConfig:
    """What a processor runs and on how many actors.

    `model`: a preset name, a checkpoint directory or a hub id, as `LLM` takes it (every node of the
    cluster must reach it). `engine_kwargs`: `EngineConfig` fields (`max_num_seqs`, `max_model_len`,
    `quantization`, ...). `concurrency`: engine actors. `batch_size`: rows handed to an actor at once
    (its engine runs `max_num_seqs` of them at a time, the rest wait in its queue). `num_cpus`,
    `num_gpus`: each actor's resources (Ray gives an actor as many torch threads as its whole CPUs,
    at least one). `device`, `dtype`: as `LLM` takes them ("auto": the GPU when the actor has one).
    """

    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    batch_size: int = 32
    num_cpus: float = 1
    num_gpus: float = 0
    device: str = "auto"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.engine_config()  # bad engine_kwargs fail here, on the driver, rather than in every actor

    def engine_config(self) -> EngineConfig:
        """`engine_kwargs` as an `EngineConfig`; a ValueError naming unknown fields or a bad value."""
        unknown = sorted(set(self.engine_kwargs) - ENGINE_FIELDS)
        if unknown:
            raise ValueError(f"engine_kwargs has unknown field(s) {', '.join(unknown)}; it takes the EngineConfig "
                             f"fields: {', '.join(sorted(ENGINE_FIELDS))}")
        return EngineConfig(**self.engine_kwargs)


class Processor:
    """`processor(ds)`: `ds` with every row answered. Lazy, as every Ray Data transform: the engines
    start and run when the result is consumed (`take_all()`, `write_parquet(...)`, ...)."""

    def __init__(self, config: ProcessorConfig, preprocess: RowFn | None = None,
                 postprocess: RowFn | None = None) -> None:
        self.config = config
        self.preprocess = preprocess
        self.postprocess = postprocess

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        c = self.config
        return ds.map_batches(GenerateBatch, batch_format="pyarrow", batch_size=c.batch_size,
                              compute=ray.data.ActorPoolStrategy(size=c.concurrency),
                              num_cpus=c.num_cpus, num_gpus=c.num_gpus,
                              fn_constructor_kwargs={"config": c, "preprocess": self.preprocess,
                                                     "postprocess": self.postprocess})


def build_processor(config: ProcessorConfig, preprocess: RowFn | None = None,
                    postprocess: RowFn | None = None) -> Processor:
    """A processor that answers each row of a dataset with `config.model`. `preprocess` turns an
    input row into the row the engine reads (`prompt` or `messages`, optionally `sampling_params`,
    any other columns kept); `postprocess` turns the answered row into the output row. Both take
    and return a dict of plain Python values, and run inside the engine actors."""
    return Processor(config, preprocess, postprocess)


class GenerateBatch:
    """One engine actor of the pool: builds its `LLM` once, then answers a batch of rows per call
    (Ray Data runs one call of an actor at a time, as the engine needs)."""

    def __init__(self, config: ProcessorConfig, preprocess: RowFn | None = None,
                 postprocess: RowFn | None = None) -> None:
        self.llm = LLM(config.model, device=config.device, dtype=config.dtype, engine_config=config.engine_config())
        tok = self.llm.tokenizer
        # As the HTTP API renders chat (service/openai/serving.py): the tokenizer's template and special tokens.
        self.chat_template = ChatTemplate(tok.chat_template, bos_token=tok.bos_token or "",
                                          eos_token=tok.eos_token or "")
        self.preprocess = preprocess
        self.postprocess = postprocess
        self._vocab_size = self.llm.engine.model_config.vocab_size
        self._max_model_len = self.llm.engine.runtime.max_model_len
        logger.info("offline engine ready: model=%s max_model_len=%d", config.model, self._max_model_len)

    def __call__(self, batch: pa.Table) -> dict[str, list[Any]]:
        rows = [_checked_row(self.preprocess(row), "preprocess") if self.preprocess else row
                for row in batch.to_pylist()]
        prompts, params = self.requests(rows)
        outs = self.llm.generate(prompts, params) if rows else []
        answered = [row | output_fields(out) for row, out in zip(rows, outs, strict=True)]
        if self.postprocess is not None:
            answered = [_checked_row(self.postprocess(row), "postprocess") for row in answered]
        return columns(answered)

    def requests(self, rows: list[Row]) -> tuple[list[list[int]], list[SamplingParams]]:
        """Each row's prompt token ids and sampling parameters, checked against the model as the
        engine checks them; a ValueError naming every row of the batch that cannot run."""
        prompts, params, problems = [], [], []
        for i, row in enumerate(rows):
            try:
                p = self.sampling_params(row.get("sampling_params"))
                ids = self.prompt_ids(row)
                check_request(ids, p, self._vocab_size, self._max_model_len,
                              param="prompt" if row.get("prompt") is not None else "messages")
                check_structured(p)
            except ValueError as exc:
                problems.append(f"row {i} {_short(repr(row), _ROW_CHARS)}: {exc}")
                continue
            prompts.append(ids)
            params.append(p)
        if problems:
            listed = "\n".join(problems[:_MAX_LISTED])
            more = f"\n(and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
            raise ValueError(f"{len(problems)} of the {len(rows)} rows of a batch cannot run, so the batch "
                             f"did not run:\n{listed}{more}")
        return prompts, params

    def sampling_params(self, value: Any) -> SamplingParams:
        """A row's `sampling_params` (None: none given) over the model's defaults."""
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ValueError(f"sampling_params must be a dict of SamplingParams fields, got {_short(repr(value))}")
        given = {k: v for k, v in value.items() if v is not None}  # None: the Arrow stand-in for a missing key
        unanswered = sorted(set(given) & UNANSWERED_FIELDS)
        if unanswered:
            raise ValueError(f"sampling_params {', '.join(unanswered)}: the processor's rows do not carry logprobs; "
                             "leave it out")
        unknown = sorted(set(given) - SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"sampling_params has unknown key(s) {', '.join(map(repr, unknown))}; it takes "
                             f"{', '.join(sorted(SAMPLING_FIELDS))}")
        if isinstance(given.get("logit_bias"), dict):  # JSON and Arrow keys are strings, as the HTTP API's are
            given["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                                   for k, v in given["logit_bias"].items() if v is not None}
        try:
            return self.llm.engine.generation_config.default_sampling_params(**given)
        except ValueError as exc:
            raise ValueError(f"sampling_params: {exc}") from None

    def prompt_ids(self, row: Row) -> list[int]:
        """The token ids of a row's `prompt` (encoded as `LLM.generate` encodes text) or `messages`."""
        prompt, messages = row.get("prompt"), row.get("messages")
        if prompt is not None and messages is not None:
            raise ValueError("a row takes prompt or messages, not both")
        if messages is not None:
            # The template writes the special tokens itself, as on the HTTP API.
            return self.llm.tokenizer.encode(self.render(messages), add_special_tokens=False)
        if isinstance(prompt, str):
            return self.llm.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if prompt is None:
            raise ValueError("a row needs prompt (text or a list of token ids) or messages (OpenAI chat messages)")
        raise ValueError(f"prompt must be a string or a list of token ids, got {_short(repr(prompt))}")

    def render(self, messages: Any) -> str:
        """The prompt text of OpenAI chat messages, through the model's chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages must be a non-empty list of chat messages, got {_short(repr(messages))}")
        parsed = []
        for j, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{j}] must be a dict with role and content, got {_short(repr(message))}")
            try:
                parsed.append(ChatMessage.model_validate(message))
            except ValidationError as exc:
                raise ValueError(f"messages[{j}]: {from_validation_error(exc).message}") from None
            if parsed[-1].image_parts():
                raise ValueError(f"messages[{j}] has image_url parts; the offline processor takes text only")
        try:
            return self.chat_template.render(parsed)
        except APIError as exc:
            raise ValueError(exc.message) from None


def output_fields(out: CompletionOutput) -> Row:
    """The columns an answered row gains (`OUTPUT_FIELDS`)."""
    return {"generated_text": out.text, "generated_tokens": list(out.token_ids),
            "num_input_tokens": len(out.prompt_token_ids), "num_generated_tokens": len(out.token_ids),
            "finish_reason": out.finish_reason}


def columns(rows: list[Row]) -> dict[str, list[Any]]:
    """Rows as the columns Ray Data takes back: every key of any row, None where a row lacks it."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}


def _checked_row(row: Any, fn: str) -> Row:
    if not isinstance(row, dict):
        raise ValueError(f"{fn} must return a row (a dict), got {type(row).__name__}")
    return row


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
