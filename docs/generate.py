"""The generated parts of the docs: each fact has one home in the code or in a result file, and
the pages include it from there instead of retyping it.

A page asks for a part with a start marker alone on its line; the generated text follows it,
committed in the page, up to an end marker:

    <!-- generated: arguments NAME ... -->

    | Argument | Type | ... (written by this script) |

    <!-- end generated -->

The parts:

    arguments                every argument: `AppArgs` (serve) and `EngineConfig` (LLM)
    arguments NAME NAME ...  the rows of those arguments only (a feature page's)
    speculative_config       the keys of `speculative_config`
    metrics                  every metric the service exports
    metrics PREFIX ...       the metrics whose name starts with one of these (a feature page's)
    bench NAME [TABLE]       the table of docs/results/NAME.json (or its table TABLE), with its provenance
    models_features          each architecture of the model registry against the features it takes
    api_fields MODEL         every field of one request model of the HTTP API, and how it is treated
    serving_env              the Ray Serve settings `python -m service.launch` applies
    layers PACKAGE           the parts of model/ or service/, what each holds and what it may import

`python docs/generate.py --write` rewrites the generated text of every page (a start marker
without its end marker gets both); `--check` lists the pages whose text is out of date.
tests/docs/test_docs_generated.py fails on such a page, and the mkdocs hook (docs/hooks.py) warns,
which fails `mkdocs build --strict`.

Descriptions come from `Field(description=...)` on `service.app.AppArgs` and from the field
metadata of the `model.config.EngineConfig` dataclass (`model.config.described`), which `AppArgs`
takes for the arguments it shares with the engine; metrics from `service.engine.metrics.METRICS`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from types import ModuleType, NoneType, UnionType
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
RESULTS_MODULE = "loadtests.lib.results"  # the result files' writer and schema

MARKER = re.compile(r"^<!-- generated: (?P<kind>[a-z_]+)(?P<args>(?: +[^ ]+)*) *-->$")
END_MARKER = "<!-- end generated -->"
WRITE_COMMAND = "python docs/generate.py --write"


@dataclasses.dataclass(frozen=True)
class Argument:
    """One row of the argument reference."""

    name: str
    type: str
    default: str
    applies_to: tuple[str, ...]  # "serve" (an app argument), "LLM" (a keyword of LLM(...)), "EngineConfig"
    description: str


def update_page(markdown: str, results_dir: Path = RESULTS) -> str:
    """`markdown` as it is committed: after every start marker, what it asks for now, then the end
    marker (a start marker without an end marker before the next start marker gets one). ValueError
    for a marker that names an unknown part, argument or result file, and for a stray end marker."""
    lines = markdown.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END_MARKER:
            raise ValueError(f"line {i + 1}: '{END_MARKER}' without a '<!-- generated: ... -->' before it")
        match = MARKER.match(line.strip())
        i += 1
        if not match:
            out.append(line)
            continue
        end = _end_of_block(lines, i)
        out += [line, "", render_marker(match["kind"], match["args"].split(), results_dir), "", END_MARKER]
        if end is not None:
            i = end + 1
    return "\n".join(out)


def _end_of_block(lines: list[str], start: int) -> int | None:
    """The index of the end marker of the block whose body starts at `start`; None when another
    start marker (or the page's end) comes first."""
    for j in range(start, len(lines)):
        if lines[j].strip() == END_MARKER:
            return j
        if MARKER.match(lines[j].strip()):
            return None
    return None


def render_page(markdown: str, results_dir: Path = RESULTS) -> str:
    """The page as the site shows it: the generated text as `update_page` makes it, markers left out."""
    return "\n".join(line for line in update_page(markdown, results_dir).split("\n")
                     if not (MARKER.match(line.strip()) or line.strip() == END_MARKER))


def pages(docs: Path = REPO / "docs") -> list[Path]:
    """Every page of the site."""
    return sorted(docs.rglob("*.md"))


def stale_pages(paths: list[Path] | None = None, results_dir: Path = RESULTS) -> list[Path]:
    """The pages whose committed generated text differs from what the code and results give now."""
    return [p for p in (pages() if paths is None else paths)
            if update_page(p.read_text(), results_dir) != p.read_text()]


def render_marker(kind: str, args: list[str], results_dir: Path = RESULTS) -> str:
    if kind == "arguments":
        return arguments_table(args or None)
    if kind == "speculative_config" and not args:
        return speculative_config_table()
    if kind == "metrics":
        return metrics_table(args or None)
    if kind == "bench" and len(args) == 1:
        return bench_table(args[0], results_dir)
    if kind == "bench" and len(args) == 2:
        return bench_extra_table(args[0], args[1], results_dir)
    if kind == "models_features" and not args:
        return models_features_table()
    if kind == "api_fields" and len(args) == 1:
        return api_fields_table(args[0])
    if kind == "serving_env" and not args:
        return serving_env_table()
    if kind == "layers" and len(args) == 1:
        return layers_table(args[0])
    if kind == "memory_sizes" and not args:
        return memory_sizes_table()
    raise ValueError(f"unknown docs marker 'generated: {' '.join([kind, *args])}'; known: arguments [NAME ...], "
                     "speculative_config, metrics [PREFIX ...], bench NAME [TABLE], models_features, memory_sizes, "
                     f"api_fields MODEL ({', '.join(REQUEST_MODELS)}), serving_env, layers model|service")


# ---- arguments ------------------------------------------------------------------------------

def arguments() -> list[Argument]:
    """Every app argument (in `AppArgs` order), then the `EngineConfig` fields that are not app
    arguments; an argument of both is one row, its description and default the engine's."""
    from model.config import EngineConfig
    from model.llm import LLM
    from service.app import AppArgs

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    engine_types = typing.get_type_hints(EngineConfig)
    llm_params = set(inspect.signature(LLM).parameters) - {"engine_args", "engine_config"}
    rows = []
    for name, info in AppArgs.model_fields.items():
        where = ("serve", *(("LLM",) if name in engine or name in llm_params else ()),
                 *(("EngineConfig",) if name in engine else ()))
        rows.append(Argument(name, type_name(info.annotation) + constraints(info.metadata), format_default(info.default),
                             where, info.description or engine_description(engine.get(name))))
    for name, f in engine.items():
        if name not in AppArgs.model_fields:
            rows.append(Argument(name, type_name(engine_types[name]), format_default(f.default), ("LLM", "EngineConfig"),
                                 engine_description(f)))
    return rows


def engine_description(f: dataclasses.Field | None) -> str:
    return f.metadata.get("description", "") if f is not None else ""


def arguments_table(names: list[str] | None = None) -> str:
    """The argument reference as a markdown table; `names`: only those rows, in that order."""
    rows = {a.name: a for a in arguments()}
    if names:
        unknown = [n for n in names if n not in rows]
        if unknown:
            raise ValueError(f"docs marker names unknown argument(s) {', '.join(unknown)}")
    chosen = [rows[n] for n in names] if names else list(rows.values())
    return table(["Argument", "Type", "Default", "Where", "Description"],
                 [[f"`{a.name}`", f"`{a.type}`", f"`{a.default}`", ", ".join(a.applies_to), a.description]
                  for a in chosen])


def speculative_config_table() -> str:
    """The keys of the `speculative_config` argument (model/config/speculative.py)."""
    from model.config.speculative import SpeculativeConfig

    hints = typing.get_type_hints(SpeculativeConfig)
    return table(["Key", "Type", "Default", "Description"],
                 [[f"`{f.name}`", f"`{type_name(hints[f.name])}`",
                   "required" if f.default is dataclasses.MISSING else f"`{format_default(f.default)}`",
                   f.metadata.get("description", "")] for f in dataclasses.fields(SpeculativeConfig)])


def type_name(tp: Any) -> str:
    """`int | None`, `"auto" | "cpu"`, `dict[str, Any]`: the annotation as a user reads it."""
    if tp is NoneType or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:  # a constrained member of a union: `int (≥ 1) | None`
        base, *metadata = typing.get_args(tp)
        limits = _limits(metadata)
        return type_name(base) + (f" ({', '.join(limits)})" if limits else "")
    if origin is Literal:
        return " | ".join(json.dumps(v) for v in typing.get_args(tp))
    if origin in (typing.Union, UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    if tp is Any:
        return "Any"
    return getattr(tp, "__name__", str(tp))


def constraints(metadata: list[Any]) -> str:
    """Pydantic's range constraints (`Field(ge=1)`) as `, ≥ 1`."""
    parts = _limits(metadata)
    return f", {', '.join(parts)}" if parts else ""


def _limits(metadata: list[Any]) -> list[str]:
    """`≥ 1`, `length ≤ 8` for the range and length constraints in `metadata` (annotated-types
    objects, or a pydantic FieldInfo holding them)."""
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    flat = [c for m in metadata for c in (getattr(m, "metadata", None) or [m])]
    parts = [f"{symbols[k]} {getattr(m, k)}" for m in flat for k in symbols if getattr(m, k, None) is not None]
    parts += [f"length ≤ {m.max_length}" for m in flat if getattr(m, "max_length", None) is not None]
    return parts


def format_default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


# ---- metrics --------------------------------------------------------------------------------

def metrics_table(prefixes: list[str] | None = None) -> str:
    """The metrics in `service.engine.metrics.METRICS` (those whose registered name starts with one
    of `prefixes`, if given), under the name Prometheus sees (Ray's `ray_` prefix)."""
    from service.engine.metrics import METRICS, exported_name

    chosen = [m for m in METRICS if prefixes is None or m.name.startswith(tuple(prefixes))]
    if not chosen:
        raise ValueError(f"docs marker 'generated: metrics {' '.join(prefixes or [])}': no metric has such a name")
    suffixes = {"histogram": " (`_bucket`, `_sum`, `_count`)", "counter": "", "gauge": ""}
    return table(["Metric", "Type", "Labels", "Description"],
                 [[f"`{exported_name(m)}`{suffixes[m.kind]}", m.kind, ", ".join(f"`{lb}`" for lb in m.all_labels),
                   m.description] for m in chosen])


# ---- memory sizes -------------------------------------------------------------------------

MEMORY_SIZES_GB = (24, 48, 80, 141)  # common GPU memory sizes, in GB (10^9 bytes)


def memory_sizes_table(utilization: float = 0.9, block_size: int = 16) -> str:
    """For each of `model.models.reference_configs`: its bfloat16 weights (the model built on the
    meta device from its config.json), K and V bytes per token, and the KV cache room on each GPU
    size at `utilization` before the activation peak, in tokens and in sequences of its own
    context length (model/engine/memory.py's arithmetic)."""
    import torch

    from model.engine.memory import GiB, module_bytes
    from model.layers.kv_cache import KVCache
    from model.models.reference_configs import REFERENCE_CONFIGS
    from model.models.registry import ARCHITECTURES, build_model

    rows = []
    for name, raw in REFERENCE_CONFIGS.items():
        cfg = ARCHITECTURES[raw["architectures"][0]].parse_config(raw, True)
        with torch.device("meta"):
            weights = module_bytes(build_model(cfg).to(torch.bfloat16))
        per_token = KVCache.bytes_per_block(cfg.n_layers, block_size, cfg.kv_heads, cfg.d_head,
                                            torch.bfloat16) // block_size
        row = [f"`{name}`", f"{weights / GiB:.1f} GiB", f"{per_token // 1024} KiB", f"{cfg.max_position:,}"]
        for gb in MEMORY_SIZES_GB:
            room = int(utilization * gb * 10**9) - weights
            if room < per_token * block_size:
                row.append("weights do not fit")
            else:
                tokens = room // per_token
                row.append(f"{tokens / 1000:,.0f}k tokens ({tokens / cfg.max_position:.1f}x)")
        rows.append(row)
    return table(["Model (bfloat16)", "Weights", "K+V per token", "Context",
                  *(f"{gb} GB" for gb in MEMORY_SIZES_GB)], rows)


# ---- models x features ----------------------------------------------------------------------

# transformers' default config of an architecture stands for its checkpoints, with these changes
# where the default is not a model anyone publishes: Qwen2-VL's default pairs its 7B vision tower
# with a 72B-wide decoder and has no M-RoPE sections, so the probe takes Qwen2-VL-7B-Instruct's
# decoder width, heads and `mrope_section`.
_QWEN2_VL_7B = {"text_config": {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                                "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}}
PROBE_CONFIG_CHANGES: dict[str, dict[str, Any]] = {
    "Qwen2VLForConditionalGeneration": _QWEN2_VL_7B,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL_7B,
}
# The window settings an HF config may have; those the architecture's config defines are switched on.
WINDOW_SETTINGS = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}


@dataclasses.dataclass(frozen=True)
class ArchitectureFeatures:
    """What one `architectures[0]` of the registry takes, read from the code that would run it."""

    architecture: str
    arch: str  # ModelConfig.arch: the module family
    quantized: str  # which layers int8/int4 (and GPTQ/AWQ) quantize
    lora: str  # the linear layers an adapter may target
    tensor_parallel: bool
    window: str  # "every layer", "some layers", or ""
    moe: bool
    vision: str  # the vision kind, or ""


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def probe_config(architecture: str, spec: Any) -> Any:
    """The ModelConfig the registry's parser makes of `architecture`'s default HF config (with
    `PROBE_CONFIG_CHANGES`, and every window setting it defines switched on), or of the project's
    own preset for an architecture transformers does not have."""
    import transformers

    from model.config import ModelConfig

    hf_class = getattr(transformers, architecture, None)
    if hf_class is None:
        raw = spec.config_json(ModelConfig())
    else:
        defaults = hf_class.config_class().to_dict()
        raw = hf_class.config_class(**{k: v for k, v in WINDOW_SETTINGS.items() if k in defaults}).to_dict()
        raw = _merge(raw, PROBE_CONFIG_CHANGES.get(architecture, {}))
    return spec.parse_config({**raw, "architectures": [architecture]}, True)


def architecture_features(architecture: str, spec: Any) -> ArchitectureFeatures:
    """Built on the meta device: the layers quantization swaps (`swap_linears`), the adapters'
    targets (`lora_targets`), the tensor-parallel check (`check_shardable`), the layers' windows."""
    import torch

    from model.engine.parallel.sharding import check_shardable
    from model.layers.linear.quantized import QuantizedLinear
    from model.layers.lora import lora_targets
    from model.loading.quant.quantize import on_the_fly_scheme, swap_linears
    from model.models.registry import build_model

    cfg = probe_config(architecture, spec)
    with torch.device("meta"):
        net = build_model(cfg)
        quantized = build_model(cfg)
        swap_linears(quantized, on_the_fly_scheme("int8", 128))
    count = sum(isinstance(m, QuantizedLinear) for m in quantized.modules())
    floats = [what for what, stays in (("experts", cfg.moe is not None),
                                       ("vision tower", bool(getattr(net, "float_prefixes", ())))) if stays]
    quant = ("every linear layer" if count else "") + (f" ({' and '.join(floats)} in float)" if floats else "")
    try:
        check_shardable(cfg, 1)
        shardable = True
    except ValueError:
        shardable = False
    windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]
    window = "" if all(w is None for w in windows) else "every layer" if all(windows) else "some layers"
    targets = sorted({name.rsplit(".", 1)[-1] for name in lora_targets(net)})
    return ArchitectureFeatures(architecture, cfg.arch, quant, ", ".join(f"`{t}`" for t in targets), shardable,
                                window, cfg.moe is not None, cfg.vision.kind if cfg.vision is not None else "")


def models_features_table() -> str:
    """Every architecture of `model.models.registry.ARCHITECTURES` against the features that depend on it."""
    from model.models.registry import ARCHITECTURES

    rows = [architecture_features(name, spec) for name, spec in ARCHITECTURES.items()]
    yes = "yes"
    return table(["`architectures[0]`", "Family", "Quantized (int8, int4, GPTQ, AWQ)", "LoRA targets",
                  "Tensor parallel", "Sliding window", "MoE", "Images in"],
                 [[f"`{r.architecture}`", f"`{r.arch}`", r.quantized or "–", r.lora or "–",
                   yes if r.tensor_parallel else "–", r.window or "–", yes if r.moe else "–",
                   f"yes (`{r.vision}`)" if r.vision else "–"] for r in rows])


# ---- API compatibility ----------------------------------------------------------------------

# The request models of the HTTP API: marker name -> (module, class, what it is).
REQUEST_MODELS: dict[str, tuple[str, str, str]] = {
    "completions": ("service.openai.protocol", "CompletionRequest", "`POST /v1/completions`"),
    "chat": ("service.openai.protocol", "ChatCompletionRequest", "`POST /v1/chat/completions`"),
    "chat_message": ("service.openai.protocol", "ChatMessage", "each of chat's `messages`"),
    "responses": ("service.openai.responses_protocol", "ResponsesRequest", "`POST /v1/responses`"),
    "embeddings": ("service.openai.embeddings", "EmbeddingRequest", "`POST /v1/embeddings`"),
    "messages": ("service.anthropic.protocol", "MessagesRequest", "`POST /v1/messages`"),
    "count_tokens": ("service.anthropic.protocol", "CountTokensRequest", "`POST /v1/messages/count_tokens`"),
}
# Declared fields the server accepts and that change nothing in the answer (what a model's code
# declares for a client's sake). Each is checked against its model by tests/docs/test_docs_api_table.py.
NO_EFFECT: dict[str, dict[str, str]] = {
    "CompletionRequest": {"user": "accepted; changes nothing"},
    "ChatCompletionRequest": {"user": "accepted; changes nothing"},
    "EmbeddingRequest": {"user": "accepted; changes nothing"},
    "ResponsesRequest": {"user": "echoed in the response; changes nothing else",
                         "metadata": "kept with a stored response and echoed; changes nothing else"},
    "MessagesRequest": {name: "accepted; changes nothing" for name in (
        "metadata", "service_tier", "speed", "inference_geo", "user_profile_id", "workspace_id", "cache_control",
        "diagnostics")},
}
# What a supported field does beyond its type, where that is more than "as OpenAI/Anthropic define it";
# `{NAME}` is the module's constant NAME, listed.
NOTES: dict[str, dict[str, str]] = {
    "CompletionRequest": {"best_of": "supported only equal to `n`; else refused: 400"},
    "ResponsesRequest": {
        "include": "supported; refused: 400 for {UNSUPPORTED_INCLUDES}",
        "tools": "function tools; hosted tools ({IGNORED_TOOL_TYPES}) are dropped with a warning; other types "
                 "refused: 400",
        "text": "`format` supported; `verbosity` accepted, changes nothing",
        "reasoning": "`effort` reaches the chat template as `reasoning_effort` (`none` also as `enable_thinking: "
                     "false`); `summary` accepted, changes nothing"},
    "MessagesRequest": {
        "thinking": "`disabled` renders the chat template with `enable_thinking: false`; `budget_tokens` is checked, "
                    "and only `max_tokens` bounds the answer",
        "output_config": "`format` constrains the text to the JSON schema; `effort` accepted, changes nothing"},
}
_EXTRA = {"ignore": "ignored", "allow": "ignored", "forbid": "refused: 400 naming the field"}


def _refusal_tables(cls: type, module: ModuleType) -> dict[str, tuple[Any, ...]]:
    """Field -> its neutral values, for the fields a validator of `cls` checks against one of the
    module's `UNSUPPORTED*` tables (a 400 naming the field unless it has a neutral value)."""
    tables = [v for k, v in vars(module).items() if k.startswith("UNSUPPORTED") and isinstance(v, dict)]
    checked = [set(d.info.fields) for d in cls.__pydantic_decorators__.field_validators.values()]
    out: dict[str, tuple[Any, ...]] = {}
    for t in tables:
        if set(t) in checked:
            out |= t
    return out


def _neutral(values: tuple[Any, ...]) -> str:
    return " or ".join(f"`{json.dumps(v)}`" for v in values) if values else "null"


def _note(module: ModuleType, note: str | None) -> str | None:
    if note is None:
        return None
    return re.sub(r"\{([A-Z_]+)\}", lambda m: ", ".join(f"`{v}`" for v in sorted(getattr(module, m[1]))), note)


def api_field_rows(name: str) -> list[list[str]]:
    """[field, type, status] of every field of request model `name` (`REQUEST_MODELS`), then what
    becomes of the fields it does not declare."""
    if name not in REQUEST_MODELS:
        raise ValueError(f"docs marker 'generated: api_fields {name}': known models {', '.join(REQUEST_MODELS)}")
    module_name, class_name, _ = REQUEST_MODELS[name]
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name)
    refused = _refusal_tables(cls, module)
    quiet = NO_EFFECT.get(class_name, {})
    rows = []
    for field, info in cls.model_fields.items():
        shown = info.alias or field
        if field in refused:
            status = f"refused: 400 naming it, unless {_neutral(refused[field])}"
            kind = "–"
        else:
            kind = f"`{type_name(info.annotation)}{constraints(info.metadata)}`"
            status = quiet.get(field) or _note(module, NOTES.get(class_name, {}).get(field)) or (
                "supported (required)" if info.is_required() else "supported")
        rows.append([f"`{shown}`", kind, status])
    extra = cls.model_config.get("extra", "ignore")
    listed = getattr(module, "UNSUPPORTED", ())
    if extra == "allow" and isinstance(listed, tuple):  # embeddings: named extras are refused
        rows += [[f"`{n}`", "–", "refused: 400 naming it, unless null"] for n in listed]
    ignored_messages = getattr(module, "_IGNORED_MESSAGE_FIELDS", None) if class_name == "ChatMessage" else None
    if ignored_messages is not None:  # a message's output-only fields: dropped when neutral
        rows += [[f"`{n}`", "–", "accepted and dropped" + (f" when {_neutral(v)}; else refused: 400" if v else "")]
                 for n, v in ignored_messages.items()]
        rows.append(["any other field", "–", "refused: 400 naming the field"])
    else:
        rows.append(["any other field", "–", _EXTRA[extra]])
    return rows


def api_fields_table(name: str) -> str:
    return table(["Field", "Type", "Treatment"], api_field_rows(name))


# ---- layers -----------------------------------------------------------------------------------

LAYERING_MODULE = "tests.test_layering"  # the allowed imports between parts, written once


def layers_table(package: str) -> str:
    """Each part of `package` (model or service) in the layering test's table order: what its
    docstring says it holds, and the parts it may import."""
    import ast

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    tables = importlib.import_module(LAYERING_MODULE).LAYERS
    if package not in tables:
        raise ValueError(f"docs marker 'generated: layers {package}': known packages {', '.join(tables)}")
    rows = []
    for part, allowed in tables[package].items():
        if part == "__init__":
            continue
        folder = REPO / package / part
        source = folder / "__init__.py" if folder.is_dir() else REPO / package / f"{part}.py"
        doc = ast.get_docstring(ast.parse(source.read_text())) or ""
        shown = f"`{package}/{part}/`" if folder.is_dir() else f"`{package}/{part}.py`"
        rows.append([shown, doc.split("\n\n")[0], ", ".join(f"`{a}`" for a in sorted(allowed)) or "–"])
    return table(["Part", "What it holds", "May import"], rows)


# ---- environment ------------------------------------------------------------------------------

def serving_env_table() -> str:
    """`service.launch.SERVING_ENV`: the Ray Serve settings the launcher sets when they are unset."""
    from service.launch import SERVING_ENV

    return table(["Variable", "Value set"], [[f"`{k}`", f"`{v}`"] for k, v in SERVING_ENV.items()])


# ---- benchmark results ----------------------------------------------------------------------

def results_module() -> ModuleType:
    """loadtests/lib/results.py, which writes the result files and holds their schema."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(RESULTS_MODULE)


def read_result(name: str, results_dir: Path = RESULTS) -> dict[str, Any]:
    path = results_dir / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in results_dir.glob("*.json"))) or "none"
        raise ValueError(f"docs marker 'generated: bench {name}': no {path}; result files: {known}")
    doc = json.loads(path.read_text())
    problems = results_module().problems(doc)
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return doc


def bench_extra_table(name: str, part: str, results_dir: Path = RESULTS) -> str:
    """One of the more tables of `results_dir`/NAME.json (`tables.PART`), from the run the main table's
    provenance describes."""
    doc = read_result(name, results_dir)
    extra = doc.get("tables", {}).get(part)
    if extra is None:
        raise ValueError(f"docs marker 'generated: bench {name} {part}': {name}.json has no table {part!r}; "
                         f"it has {', '.join(doc.get('tables', {})) or 'none'}")
    return table(extra["columns"], [[format_cell(v) for v in row] for row in extra["rows"]])


def bench_table(name: str, results_dir: Path = RESULTS) -> str:
    """The table of `results_dir`/NAME.json and where its numbers came from."""
    doc = read_result(name, results_dir)
    rows = [[format_cell(v) for v in row] for row in doc["table"]["rows"]]
    return "\n\n".join(part for part in (doc.get("title") and f"**{doc['title']}**",
                                         table(doc["table"]["columns"], rows), provenance(doc)) if part)


def provenance(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    facts = [(m["cpu_model"], "{}"), (m["cores"], "{} cores"), (m["copy_bandwidth_gb_s"], "copy {} GB/s"),
             (m["matmul_peak_gflops"], "float32 matmul {} GFLOP/s")]  # None: not measured by that run
    machine = ", ".join([fmt.format(v) for v, fmt in facts if v is not None] + [m["gpu"] or "no GPU"])
    commit = f"`{doc['commit']}`" + (" with uncommitted changes" if doc.get("dirty") else "")
    lines = [f"Command: `{doc['command']}`. Run {doc['date']} at commit {commit} on {machine}."]
    for key, label in (("source", "Source"), ("note", "Note")):
        if doc.get(key):
            lines.append(f"{label}: {doc[key]}")
    return "\n\n".join(lines)


def format_cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


# ---- markdown -------------------------------------------------------------------------------

def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(str(v)) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(text: str) -> str:
    """A table cell: pipes outside code spans escaped (Python-Markdown keeps them inside), one line."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


# ---- command line -----------------------------------------------------------------------------

def main(argv: list[str], paths: list[Path] | None = None, results_dir: Path = RESULTS) -> int:
    """`--write`: rewrite the generated text of every page that is out of date; `--check`: list them."""
    if argv not in (["--write"], ["--check"]):
        print("usage: python docs/generate.py --write | --check", file=sys.stderr)
        return 2
    stale = stale_pages(paths, results_dir)
    for page in stale:
        if argv == ["--write"]:
            page.write_text(update_page(page.read_text(), results_dir))
        print(f"{'wrote' if argv == ['--write'] else 'out of date'}: {page}")
    return 1 if stale and argv == ["--check"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1:]))
