"""One source of truth per fact (issue 37): the docs' argument reference, metrics table and benchmark
tables are generated from the code and from docs/results/*.json (docs/generate.py), so what is
checked here is that those sources are complete and that what pages and the dashboard name exists:

- every app argument and engine field has a description, and an argument of both has one default;
- every argument a page names (a `serve run` / `make serve` command's `name=value`, the keys of
  an `args:` mapping in YAML, the keywords of `LLM(`, `EngineConfig(`, `SamplingParams(`,
  `build_app({...})`) exists;
- every metric a Grafana panel queries is exported under the default (HAProxy) serving path, with
  the labels the query uses;
- every result file has the command, date, commit, machine and table.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.support.docs_generator import load_generate
from tests.support.paths import REPO

generate = load_generate()
results = generate.results_module()


def pages() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


# ---- (a) descriptions -----------------------------------------------------------------------

def test_every_app_argument_and_engine_field_has_a_description() -> None:
    from model.config import EngineConfig
    from model.config.speculative import SpeculativeConfig
    from service.app import AppArgs

    missing = [f"AppArgs.{n}" for n, f in AppArgs.model_fields.items() if not (f.description or "").strip()]
    for cls in (EngineConfig, SpeculativeConfig):
        missing += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
                    if not f.metadata.get("description", "").strip()]
    assert not missing, f"fields without a description: {', '.join(missing)}"
    assert all(a.description for a in generate.arguments())


def test_an_app_argument_of_the_engine_takes_its_default_and_description_from_it() -> None:
    from model.config import EngineConfig
    from service.app import AppArgs

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    shared = [n for n in AppArgs.model_fields if n in engine]
    assert len(shared) >= 20
    for name in shared:
        app = AppArgs.model_fields[name]
        assert (app.default, app.description) == (engine[name].default, engine[name].metadata["description"]), name
    assert set(AppArgs().engine_config()) == set(shared)  # and the builder hands all of them on


def test_llm_takes_every_engine_field_by_name() -> None:
    from model.llm import LLM

    with pytest.raises(TypeError, match="unknown argument.*max_num_seq\\b.*it takes.*max_num_seqs"):
        LLM("transformer-base", max_num_seq=4)


# ---- (b) argument names on the pages --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mention:
    name: str
    kind: str  # "serve" (an app argument), "LLM", "EngineConfig", "SamplingParams", "speculative_config"
    where: str


def known_names() -> dict[str, set[str]]:
    from model.config import EngineConfig
    from model.config.speculative import SpeculativeConfig
    from model.llm import LLM
    from model.sampling.params import SamplingParams
    from service.app import AppArgs

    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    return {"serve": set(AppArgs.model_fields), "EngineConfig": engine,
            "LLM": engine | set(inspect.signature(LLM).parameters) - {"engine_args"},
            "SamplingParams": {f.name for f in dataclasses.fields(SamplingParams)},
            "speculative_config": {f.name for f in dataclasses.fields(SpeculativeConfig)}}


COMMAND = re.compile(r"\b(?:serve run|make serve)\b(?P<rest>.*)")
ASSIGNMENT = re.compile(r"(?:^|\s)([a-z][a-z0-9_]*)=")
CALLS = {"LLM": "LLM", "EngineConfig": "EngineConfig", "SamplingParams": "SamplingParams", "build_app": "serve"}
CALL = re.compile(r"\b(LLM|EngineConfig|SamplingParams|build_app)\(")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.M | re.S)


def command_mentions(text: str, where: str) -> list[Mention]:
    """`name=value` after `serve run` or `make serve` on a line (with its `\\` continuations),
    up to a comment or the next shell command."""
    text = re.sub(r"\\\n", " ", text)
    out = []
    for match in COMMAND.finditer(text):
        rest = re.split(r"\s#|&&|;|\|", match["rest"])[0]
        out += [Mention(name, "serve", where) for name in ASSIGNMENT.findall(rest)]
    return out


def args_mentions(doc: Any, where: str) -> list[Mention]:
    """The keys of every `args:` mapping in a parsed YAML document (a Serve config or a RayService,
    whose serveConfigV2 is YAML in a string), of each `models` entry and of `speculative_config`."""
    out: list[Mention] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "args" and isinstance(value, dict):
                out += app_args_mentions(value, where)
            elif key == "serveConfigV2" and isinstance(value, str):
                out += args_mentions(yaml.safe_load(value), where)
            else:
                out += args_mentions(value, where)
    elif isinstance(doc, list):
        for item in doc:
            out += args_mentions(item, where)
    return out


def app_args_mentions(args: dict[str, Any], where: str) -> list[Mention]:
    out = [Mention(str(k), "serve", where) for k in args]
    for entry in args.get("models") or []:
        if isinstance(entry, dict):
            out += app_args_mentions(entry, where)
    if isinstance(args.get("speculative_config"), dict):
        out += [Mention(str(k), "speculative_config", where) for k in args["speculative_config"]]
    return out


def call_mentions(text: str, where: str) -> list[Mention]:
    """The keyword arguments of each `LLM(`, `EngineConfig(`, `SamplingParams(` call and the keys
    of a dict literal passed to `build_app(`, wherever the call parses as Python on its own."""
    out = []
    for match in CALL.finditer(text):
        source = balanced(text, match.end() - 1)
        try:
            call = ast.parse(match[1] + source, mode="eval").body
        except SyntaxError:
            continue
        kind = CALLS[match[1]]
        names = [kw.arg for kw in call.keywords if kw.arg]
        if match[1] == "build_app":
            names = [k.value for a in call.args if isinstance(a, ast.Dict) for k in a.keys
                     if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        out += [Mention(n, kind, where) for n in names]
        for kw in call.keywords:  # LLM(speculative_config={...})
            if kw.arg == "speculative_config" and isinstance(kw.value, ast.Dict):
                out += [Mention(k.value, "speculative_config", where) for k in kw.value.keys
                        if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return out


def balanced(text: str, start: int) -> str:
    """The parenthesised text that opens at `start`, or '' when it does not close."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i + 1]
    return ""


def page_mentions(text: str, where: str) -> list[Mention]:
    out = command_mentions(text, where) + call_mentions(text, where)
    for block in FENCE.finditer(text):
        if block["lang"] in ("yaml", "yml"):
            try:
                out += args_mentions(yaml.safe_load(block["body"]), where)
            except yaml.YAMLError:
                continue
    return out


def unknown(mentions: list[Mention]) -> list[str]:
    names = known_names()
    return sorted({f"{m.where}: {m.kind} argument {m.name!r}" for m in mentions if m.name not in names[m.kind]})


def all_mentions() -> list[Mention]:
    out = []
    for page in pages():
        out += page_mentions(page.read_text(), str(page.relative_to(REPO)))
    for config in sorted((REPO / "deploy").glob("*.yaml")):
        out += args_mentions(yaml.safe_load(config.read_text()), str(config.relative_to(REPO)))
    out += command_mentions((REPO / "Makefile").read_text(), "Makefile")
    return out


def test_pages_and_configs_name_only_arguments_that_exist() -> None:
    mentions = all_mentions()
    kinds = {m.kind for m in mentions}
    assert {"serve", "LLM", "EngineConfig", "SamplingParams"} <= kinds, kinds  # the extraction finds each kind
    assert not unknown(mentions), "\n".join(unknown(mentions))


PAGE_WITH_TYPOS = """
Serve it: `python -m service.launch serve run service.app:build_app model=x max_num_seq=32  # a comment: foo=1`

```yaml
applications:
  - import_path: service.app:build_app
    args:
      model: transformer-base-trained
      max_queue_requests: 8
      speculative_config: {method: ngram, num_speculative_tokens: 3, prompt_lookup_maximum: 5}
      models:
        - {model: a, max_lora: 2}
```

```python
llm = LLM("transformer-base", max_model_length=4096, engine_config=EngineConfig(block_sz=8))
params = SamplingParams(max_tokens=8, temprature=0.5)
app = build_app({"model": "x", "num_replica": 2})
```
"""


def test_a_page_naming_arguments_that_do_not_exist_fails() -> None:
    assert unknown(page_mentions(PAGE_WITH_TYPOS, "page")) == [
        "page: EngineConfig argument 'block_sz'", "page: LLM argument 'max_model_length'",
        "page: SamplingParams argument 'temprature'", "page: serve argument 'max_lora'",
        "page: serve argument 'max_num_seq'", "page: serve argument 'max_queue_requests'",
        "page: serve argument 'num_replica'", "page: speculative_config argument 'prompt_lookup_maximum'"]
    fixed = PAGE_WITH_TYPOS
    for wrong, right in (("max_num_seq=", "max_num_seqs="), ("max_queue_requests", "max_queued_requests"),
                         ("prompt_lookup_maximum", "prompt_lookup_max"), ("max_lora:", "max_loras:"),
                         ("max_model_length", "max_model_len"), ("block_sz", "block_size"),
                         ("temprature", "temperature"), ("num_replica", "num_replicas")):
        fixed = fixed.replace(wrong, right)
    mentions = page_mentions(fixed, "page")
    assert len(mentions) == 18 and not unknown(mentions)


# ---- (c) the Grafana dashboard --------------------------------------------------------------

# Ray Serve's own metrics that the dashboard may use: exported with the default serving path
# (service.launch.SERVING_ENV: HAProxy, direct ingress), with these labels, as a service on Ray
# 2.60 exports them (its metrics agent's /metrics, read after traffic); tests/e2e/test_prometheus.py
# checks that each query returns data. Under HAProxy the HTTP counters come from HAProxy's log
# (requests it answered itself included) and their `route` is the application's route prefix
# ("/"), not the request's path, so it is not listed: a per-path query of them finds nothing.
SERVE_METRICS = {
    "ray_serve_num_http_requests_total": {"application", "method", "status_code"},
    "ray_serve_num_http_error_requests_total": {"application", "method", "error_code"},
    "ray_serve_deployment_replica_healthy": {"application", "deployment", "replica"},
    "ray_serve_autoscaling_target_replicas": {"application", "deployment"},
    "ray_serve_replica_processing_queries": {"application", "deployment", "replica"},
}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "le"}
SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?")
FUNCTION = re.compile(r"\b([a-zA-Z_]\w*)\s*\(")


def exported_metrics() -> dict[str, set[str]]:
    """Every series name Prometheus gets for the service's metrics, with the labels it carries."""
    from service.engine.metrics import METRICS, RAY_LABELS, exported_name

    out = {}
    for m in METRICS:
        labels = set(m.all_labels) | set(RAY_LABELS)
        names = [f"{exported_name(m)}{s}" for s in ("_bucket", "_sum", "_count")] if m.kind == "histogram" \
            else [exported_name(m)]
        for n in names:
            out[n] = labels | ({"le"} if n.endswith("_bucket") else set())
    return out | SERVE_METRICS


def query_problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What a panel query names that the service does not export: metrics, and labels of a metric's
    selector or of a `by (...)` clause that none of the query's metrics carries."""
    concrete = re.sub(r"\[[^\]]*\]", "", expr.replace("$__rate_interval", "1m"))
    grouped = {lb.strip() for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", concrete)
               for lb in clause.split(",") if lb.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", concrete)
    text = re.sub(r'"[^"]*"', '""', text)  # label values are not names
    functions = set(FUNCTION.findall(text))  # and aggregations: `sum (`, once `by (...)` is gone
    problems, seen = [], set()
    for name, selector in SELECTOR.findall(text):
        if name in functions or name in PROMQL_WORDS or re.fullmatch(r"[\d.e]+", name):
            continue
        if name not in exported:
            problems.append(f"metric {name} is not exported")
            continue
        seen |= exported[name]
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector or ""):
            if label not in exported[name]:
                problems.append(f"{name} has no label {label!r}")
    problems += [f"no metric of the query has label {lb!r}" for lb in sorted(grouped - seen) if seen]
    return problems


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, query) of every panel target, and each `label_values(metric, label)` variable as
    the query `metric{label=~".*"}`."""
    out = []
    for path in sorted((REPO / "deploy" / "grafana").rglob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash.get("panels", []):
            out += [(panel.get("title", "?"), t["expr"]) for t in panel.get("targets", []) if "expr" in t]
        for var in dash.get("templating", {}).get("list", []):
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else ""
            out += [(f"variable {var['name']}", f'{metric}{{{label}=~".*"}}')
                    for metric, label in re.findall(r"label_values\(\s*(\w+)\s*,\s*(\w+)\s*\)", query)]
    return out


def test_every_dashboard_query_names_metrics_exported_under_haproxy() -> None:
    exported = exported_metrics()
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    problems = [f"{title}: {p}" for title, expr in exprs for p in query_problems(expr, exported)]
    assert not problems, "\n".join(problems)


def test_the_dashboard_check_fails_on_a_metric_or_label_that_is_not_there() -> None:
    exported = exported_metrics()
    assert query_problems('sum by (status_code) (rate(ray_serve_num_http_requests_total{route=~"/v1/.*"}[5m]))',
                          exported) == ["ray_serve_num_http_requests_total has no label 'route'"]
    assert query_problems("sum(rate(ray_serve_num_router_requests_total[1m]))", exported) == [
        "metric ray_serve_num_router_requests_total is not exported"]
    assert query_problems("sum by (lora_name) (ray_qkv_num_requests_running)", exported) == [
        "no metric of the query has label 'lora_name'"]
    assert query_problems('histogram_quantile(0.9, sum by (le) (rate(ray_qkv_e2e_request_latency_seconds_bucket'
                          '{model_name=~"$model"}[$__rate_interval])))', exported) == []


# ---- (d) result files -----------------------------------------------------------------------

def test_every_result_file_has_its_provenance_and_a_table() -> None:
    files = sorted((REPO / "docs" / "results").glob("*.json"))
    assert files, "docs/results/ has no result files"
    bad = {f.name: p for f in files if (p := results.problems(json.loads(f.read_text())))}
    assert not bad, bad


def test_the_result_check_names_what_is_missing() -> None:
    doc = {"benchmark": "b", "command": "python x.py", "date": "2026-12-03", "commit": "abc",
           "machine": {"cpu_model": "cpu", "cores": 2, "copy_bandwidth_gb_s": 10.0, "matmul_peak_gflops": 100.0,
                       "gpu": None},
           "table": {"columns": ["a", "b"], "rows": [[1, 2]]}}
    assert results.problems(doc) == []
    assert results.problems({k: v for k, v in doc.items() if k != "commit"}) == ["missing key 'commit'"]
    assert results.problems({**doc, "machine": {"cpu_model": "cpu"}}) == [
        "machine lacks 'cores'", "machine lacks 'copy_bandwidth_gb_s'", "machine lacks 'matmul_peak_gflops'",
        "machine lacks 'gpu'"]
    assert results.problems({**doc, "table": {"columns": ["a", "b"], "rows": [[1]]}}) == [
        "table row 0 has 1 cells for 2 columns"]
    assert results.problems({**doc, "tables": {"cpu": {"columns": ["a"], "rows": [[1, 2]]}}}) == [
        "tables.cpu row 0 has 2 cells for 1 columns"]
    assert results.problems({**doc, "tables": {"cpu": {"columns": [], "rows": []}}}) == [
        "tables.cpu.columns must be a non-empty list"]


# ---- the generated parts --------------------------------------------------------------------

def test_every_page_renders_its_markers() -> None:
    for page in pages():
        text = page.read_text()
        rendered = generate.render_page(text)  # raises on an unknown marker, argument or result file
        assert "<!-- generated:" not in rendered, page


def test_markers_render_tables_from_their_sources(tmp_path: Path) -> None:
    from service.engine.metrics import METRICS

    doc = {"benchmark": "demo", "command": "python loadtests/benchmarks/demo.py --out x.json", "date": "2026-12-03",
           "commit": "abc1234", "machine": {"cpu_model": "Some CPU", "cores": 2, "copy_bandwidth_gb_s": 10.0,
                                            "matmul_peak_gflops": 100.0, "gpu": None},
           "table": {"columns": ["case", "tok/s"], "rows": [["a | b", 12.5]]}, "note": "noisy",
           "tables": {"cpu": {"columns": ["part", "ms"], "rows": [["edge", 0.125]]}}}
    (tmp_path / "demo.json").write_text(json.dumps(doc))
    page = ("# T\n\n<!-- generated: arguments -->\ntext\n<!-- generated: metrics -->\n<!-- generated: bench demo -->\n"
            "<!-- generated: bench demo cpu -->\n")
    out = generate.render_page(page, tmp_path)
    assert "| part | ms |\n|---|---|\n| edge | 0.125 |" in out
    assert "| `max_num_seqs` | `int, ≥ 1` | `64` | serve, LLM, EngineConfig |" in out
    assert "| `gpu_memory_utilization` |" in out and "| LLM, EngineConfig |" in out
    assert all(f"`ray_{m.name}`" in out for m in METRICS)
    assert "| a \\| b | 12.5 |" in out and "Note: noisy" in out and "`abc1234`" in out
    assert "\ntext\n" in out
    some = generate.render_page("<!-- generated: metrics qkv_kv_offload qkv_num_requests -->\n", tmp_path)
    chosen = {m.name for m in METRICS if m.name.startswith(("qkv_kv_offload", "qkv_num_requests"))}
    assert len(chosen) > 2 and all(f"`ray_{m.name}`" in some for m in METRICS if m.name in chosen)
    assert not any(f"`ray_{m.name}`" in some for m in METRICS if m.name not in chosen)
    for bad in ("<!-- generated: bench nothing -->", "<!-- generated: arguments max_num_seq -->",
                "<!-- generated: nonsense -->", "<!-- generated: bench demo gpu -->",
                "<!-- generated: metrics qkv_no_such_metric -->"):
        with pytest.raises(ValueError):
            generate.render_page(bad, tmp_path)
