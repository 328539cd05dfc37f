"""What structured outputs cost: throughput of a batch where half the requests are JSON-schema
constrained against the same batch unconstrained, and schema compile time, cold and cached.

Everything in one run, on one random-weight model with a realistic vocabulary: our Transformer
(d_model 512, 6 layers) with a 32k byte-level BPE tokenizer trained here on the Python standard
library's sources (deterministic, nothing downloaded).
- constrained batch: 32 requests at temperature 1.0, the even ones constrained by a 5-field JSON
  schema (they end when the JSON closes), the odd ones free text (ignore_eos, 64 tokens);
- baseline: the same 32 requests without constraints, each generating exactly as many tokens
  as it did in the constrained run (ignore_eos, max_tokens = that length), so both do the same
  model work and the difference is the grammar's;
- compile time of a realistic 20-field schema (nested object, arrays, enums, ranges, string
  limits, formats) for this tokenizer: cold (a fresh compiler) and cached; the one-off tokenizer
  set-up; the per-step mask cost of one constrained row.

With `--constraint auto` the even requests carry the constraint of `tool_choice: "auto"` over two
tools in the Hermes format (free text watched for `<tool_call>`, a schema-valid call after it:
what every agent request pays per token); `--constraint required` forces calls from the first
token (the cost inside a call).

    .venv/bin/python loadtests/benchmarks/bench_structured.py [--constraint json|auto|required] [--requests 32] [--rounds 3]
                                                   [--out results/bench_structured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LLM, SamplingParams  # noqa: E402
from model.config import EngineConfig, ModelConfig  # noqa: E402
from model.loading.checkpoint import save_model  # noqa: E402
from model.models.transformer import Transformer  # noqa: E402
from model.sampling.structured import StructuredOutputs, build_grammar  # noqa: E402
from loadtests.lib.results import add_result_args, print_table, write_result  # noqa: E402

EOS = "<|endoftext|>"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "role", "active"],
    "additionalProperties": False,
}
_S = {"type": "string", "maxLength": 32}
SCHEMA_20 = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1}, "username": _S, "full_name": _S,
        "email": {"type": "string", "format": "email"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "height_m": {"type": "number"}, "is_active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "created_at": {"type": "string", "format": "date-time"}, "birthday": {"type": "string", "format": "date"},
        "tags": {"type": "array", "items": _S, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 10},
        "address": {"type": "object", "properties": {"street": _S, "city": _S, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}, "country": {"enum": ["FR", "DE", "NO", "US"]}},
                    "required": ["street", "city", "zip", "country"], "additionalProperties": False},
        "phone": {"type": ["string", "null"], "pattern": "^\\+?[0-9 ]{6,15}$"},
        "website": {"type": "string", "format": "uri"}, "bio": {"type": "string", "maxLength": 200},
        "language": {"enum": ["en", "fr", "de", "no"]}, "timezone": _S,
        "newsletter": {"type": "boolean"}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["id", "username", "full_name", "email", "age", "is_active", "role", "created_at", "tags",
                 "scores", "address", "language", "newsletter", "rating", "height_m", "birthday", "phone",
                 "website", "bio", "timezone"],
    "additionalProperties": False,
}


def stdlib_text(max_bytes: int) -> list[str]:
    """The standard library's top-level .py sources in name order, up to `max_bytes`."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text("utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return texts


def build_checkpoint(directory: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_text(6 << 20), trainer)
    real_vocab = tok.get_vocab_size()
    # The EOS id comes from the tokenizer (tokenizer_config.json), the one source of special tokens.
    cfg = ModelConfig(vocab_size=real_vocab, d_model=512, n_heads=8, n_layers=6, d_ff=2048, max_position=1024)
    net = Transformer(cfg)
    net.init_weights(cfg.init_seed)
    save_model(net, directory)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return directory


TOOLS = [{"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "days"], "additionalProperties": False}},
         {"name": "lookup", "parameters": PERSON}]


def constraint_kwargs(kind: str) -> dict:
    """The SamplingParams of one constrained request of `kind`."""
    if kind == "json":
        return {"max_tokens": 256, "json_schema": PERSON}
    from service.tools.answer import plan_answer
    from service.tools.formats import FORMATS

    plan = plan_answer(TOOLS, kind, True, FORMATS["hermes"], None)
    return {"max_tokens": 64 if kind == "auto" else 256, **plan.constraint}


def batch(n: int, constrained: bool, lengths: list[int] | None, kind: str = "json") -> list[SamplingParams]:
    """Request i: seed i, temperature 1.0; even ones constrained by `kind` (when `constrained`),
    else `lengths[i]` (or 64) tokens of free text."""
    out = []
    for i in range(n):
        if constrained and i % 2 == 0:
            out.append(SamplingParams(temperature=1.0, seed=i, **constraint_kwargs(kind)))
        else:
            out.append(SamplingParams(max_tokens=lengths[i] if lengths else 64, temperature=1.0, seed=i,
                                      ignore_eos=True))
    return out


def timed_generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, [len(o.token_ids) for o in outs]


def throughput(llm: LLM, n: int, rounds: int, kind: str = "json") -> dict[str, float]:
    prompts = [f"Record {i}: describe the person as JSON." for i in range(n)]
    _, lengths = timed_generate(llm, prompts, batch(n, True, None, kind))  # warm-up; compiles the constraint
    constrained, plain = [], []
    for _ in range(rounds):  # alternated, so drift in the machine's load hits both alike
        secs, got = timed_generate(llm, prompts, batch(n, True, None, kind))
        assert got == lengths, "same seeds must give the same lengths"
        constrained.append(secs)
        secs, got = timed_generate(llm, prompts, batch(n, False, lengths))
        assert got == lengths
        plain.append(secs)
    tokens = sum(lengths)
    c, p = statistics.median(constrained), statistics.median(plain)
    return {"requests": n, "constrained_requests": (n + 1) // 2, "generated_tokens": tokens,
            "constrained_mean_tokens": statistics.mean(lengths[0::2]),
            "unconstrained_s": p, "constrained_s": c, "unconstrained_tok_s": tokens / p,
            "constrained_tok_s": tokens / c, "slowdown": c / p - 1}


def compile_times(llm: LLM) -> dict[str, float]:
    eng = llm.engine
    eos = eng.tokenizer.eos_token_id
    spec = SamplingParams(json_schema=SCHEMA_20).structured
    fresh = StructuredOutputs(eng.tokenizer, eng.model_config.vocab_size, [eos])
    t0 = time.perf_counter()
    fresh._get_compiler()  # one-off per engine: the tokenizer's byte table for xgrammar
    setup = time.perf_counter() - t0
    build_grammar.cache_clear()
    t0 = time.perf_counter()
    fresh.compiled(spec)
    cold = time.perf_counter() - t0
    reps = 1000
    t0 = time.perf_counter()
    for _ in range(reps):
        fresh.compiled(spec)
    cached = (time.perf_counter() - t0) / reps
    constraint = fresh.constraint(SamplingParams(json_schema=SCHEMA_20))
    logits = torch.zeros(eng.model_config.vocab_size)
    t0 = time.perf_counter()
    for _ in range(200):
        constraint(logits)
    mask = (time.perf_counter() - t0) / 200
    return {"tokenizer_setup_s": setup, "compile_20_fields_cold_s": cold, "compile_20_fields_cached_s": cached,
            "mask_per_row_step_s": mask}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constraint", choices=["json", "auto", "required"], default="json")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    add_result_args(ap, "results/bench_structured.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ckpt = build_checkpoint(Path(tmp), args.vocab)
        print(f"checkpoint with a {args.vocab}-token BPE tokenizer built in {time.perf_counter() - t0:.1f} s")
        llm = LLM(str(ckpt), device="cpu", dtype="float32", engine_config=EngineConfig(
            max_num_seqs=args.requests, kv_cache_memory_bytes=512 << 20))
        result = {"vocab_size": llm.engine.model_config.vocab_size, "torch_threads": args.threads,
                  "constraint": args.constraint,
                  "throughput": throughput(llm, args.requests, args.rounds, args.constraint),
                  "compile": compile_times(llm)}
    columns, rows = table(result)
    print_table(columns, rows)
    tp = result["throughput"]
    print(f"slowdown: {tp['slowdown'] * 100:+.1f}% (target <= +10%); {tp['generated_tokens']} tokens per run, "
          f"constrained outputs {tp['constrained_mean_tokens']:.0f} tokens on average")
    if args.out:
        write_result(args.out, "bench_structured" + ("" if args.constraint == "json" else f"_{args.constraint}"),
                     columns, rows, raw=result, note=args.note,
                     title=f"Structured outputs ({args.constraint}): a batch of {tp['requests']}, half constrained")


def table(result: dict) -> tuple[list[str], list[list[str]]]:
    tp, cp = result["throughput"], result["compile"]
    label = {"json": "half JSON-schema constrained", "auto": "half tool_choice auto (hermes)",
             "required": "half tool_choice required"}[result["constraint"]]
    schema = f"20-field schema, vocab {result['vocab_size']}"
    return ["what", "time", "tokens/s"], [
        [f"batch of {tp['requests']}, unconstrained", f"{tp['unconstrained_s']:.2f} s",
         f"{tp['unconstrained_tok_s']:.1f}"],
        [f"batch of {tp['requests']}, {label}", f"{tp['constrained_s']:.2f} s", f"{tp['constrained_tok_s']:.1f}"],
        ["slowdown", f"{tp['slowdown'] * 100:+.1f}%", ""],
        ["tokenizer set-up (once)", f"{cp['tokenizer_setup_s'] * 1e3:.1f} ms", ""],
        [f"{schema}: compile, cold", f"{cp['compile_20_fields_cold_s'] * 1e3:.1f} ms", ""],
        [f"{schema}: compile, cached", f"{cp['compile_20_fields_cached_s'] * 1e3:.4f} ms", ""],
        ["mask, one row, one step", f"{cp['mask_per_row_step_s'] * 1e3:.3f} ms", ""]]


if __name__ == "__main__":
    main()
