"""Structured outputs through the offline API: random-weight models sampling at temperature 1.0
can only emit what the constraint allows (JSON that validates, full regex matches, one of the
choices), and the constraint changes nothing for the other requests of the batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from model import LLM, SamplingParams
from model.config import EngineConfig
from model.sampling.params import StructuredSpec
from model.sampling.structured import build_grammar
from tests.support.local_serve import write_tiny_checkpoint
from tests.support.tiny_models import save_tiny_gpt2

SEEDS = range(16)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    },
    "required": ["name", "age", "tags", "ok", "score"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{3}\.(com|org)"
CHOICES = ["yes", "no", 'say "hi"', "größer"]


@pytest.fixture(scope="module")
def byte_llm(tmp_path_factory) -> LLM:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-byte"), max_position=512)
    return LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(kv_cache_memory_bytes=16 << 20))


@pytest.fixture(scope="module")
def bpe_llm(tmp_path_factory) -> LLM:
    directory = save_tiny_gpt2(tmp_path_factory.mktemp("tiny-bpe"), n_positions=256)
    return LLM(str(directory), device="cpu", dtype="float32", engine_config=EngineConfig(kv_cache_memory_bytes=8 << 20))


def sampled(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=1.0, seed=seed, **constraint)


@pytest.mark.parametrize("which", ["byte_llm", "bpe_llm"])
def test_every_json_schema_output_validates(which, request) -> None:
    llm: LLM = request.getfixturevalue(which)
    outs = llm.generate(["Describe a person:"] * len(SEEDS), [sampled(s, json_schema=PERSON) for s in SEEDS])
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > len(SEEDS) // 2  # sampled, not one fixed answer


def test_every_regex_and_choice_output_matches(byte_llm: LLM, bpe_llm: LLM) -> None:
    for llm in (byte_llm, bpe_llm):
        outs = llm.generate(["Mail:"] * len(SEEDS), [sampled(s, regex=REGEX) for s in SEEDS])
        assert all(o.finish_reason == "stop" and re.fullmatch(REGEX, o.text) for o in outs), outs
        outs = llm.generate(["Answer:"] * len(SEEDS), [sampled(s, choice=CHOICES) for s in SEEDS])
        assert all(o.finish_reason == "stop" and o.text in CHOICES for o in outs), outs
        assert len({o.text for o in outs}) > 1


def test_non_ascii_enum_and_const_values(byte_llm: LLM) -> None:
    schema = {"type": "object", "properties": {"w": {"enum": ["größer", "straße", "日本語"]}, "c": {"const": "é"}},
              "required": ["w", "c"], "additionalProperties": False}
    outs = byte_llm.generate(["Word:"] * 12, [sampled(s, json_schema=schema) for s in range(12)])
    for out in outs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > 1


def test_json_object_and_grammar(byte_llm: LLM) -> None:
    params = [SamplingParams(max_tokens=64, seed=s, json_object=True) for s in range(6)]
    outs = byte_llm.generate(["{"] * 6, params)
    for out in outs:  # truncation is allowed (unbounded structure) but must say so
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 64
    assert any(o.finish_reason == "stop" for o in outs)
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = byte_llm.generate(["Sum:"] * 6, [SamplingParams(max_tokens=64, seed=s, grammar=grammar) for s in range(6)])
    assert any(o.finish_reason == "stop" for o in outs)
    for out in outs:
        if out.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", out.text), out.text


def test_same_seed_same_output_and_truncation_reports_length(byte_llm: LLM) -> None:
    a, b = byte_llm.generate(["x", "x"], [sampled(7, json_schema=PERSON)] * 2)
    assert a.text == b.text and a.token_ids == b.token_ids
    short = byte_llm.generate("x", SamplingParams(max_tokens=5, seed=7, json_schema=PERSON))[0]
    assert short.finish_reason == "length" and short.token_ids == a.token_ids[:5]


def test_constrained_request_leaves_the_rest_of_the_batch_unchanged(byte_llm: LLM) -> None:
    prompts = ["The cat", "A dog", "Hello there"]
    plain = [SamplingParams(max_tokens=16, temperature=1.0, seed=3), SamplingParams(max_tokens=16, temperature=0.0),
             SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=5)]
    alone = byte_llm.generate(prompts, plain)
    mixed = byte_llm.generate(prompts + ["{"], plain + [sampled(1, json_schema=PERSON)])
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[3].text), PERSON)


def test_constraint_survives_preemption(byte_llm: LLM, tmp_path) -> None:
    directory = write_tiny_checkpoint(tmp_path / "m", max_position=512)  # the same weights as byte_llm
    # 7 blocks of 16 tokens cannot hold 4 sequences of ~60 tokens: preemption is forced.
    tight = LLM(str(directory), device="cpu", dtype="float32",
                engine_config=EngineConfig(num_kv_blocks=7, block_size=16))
    params = [SamplingParams(max_tokens=100, seed=s, json_schema=PERSON) for s in range(4)]
    expected = byte_llm.generate(["Person:"] * 4, params)
    got = tight.generate(["Person:"] * 4, params)
    assert tight.engine.stats().num_preemptions_total > 0
    assert [o.text for o in got] == [o.text for o in expected]
    for out in got:
        jsonschema.validate(json.loads(out.text), PERSON)


def test_a_complete_structure_wins_over_min_tokens(byte_llm: LLM) -> None:
    out = byte_llm.generate("x", SamplingParams(max_tokens=20, min_tokens=10, seed=0, choice=["ok"]))[0]
    assert (out.text, out.finish_reason) == ("ok", "stop")


@pytest.mark.parametrize("kwargs, match", [
    ({"regex": "("}, "invalid regex: .*parenthesis"),
    ({"json_schema": {"type": "nope"}}, "invalid json_schema: .*nope"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar: .*undefined_rule"),
])
def test_an_invalid_constraint_is_a_value_error_naming_it(byte_llm: LLM, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        byte_llm.generate("x", SamplingParams(**kwargs))
    assert byte_llm.generate("x", SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_two_constraints_or_bad_types_are_refused() -> None:
    with pytest.raises(ValueError, match="at most one structured-output constraint, got regex, choice"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SamplingParams(choice=[])


def test_compiled_once_per_text(byte_llm: LLM) -> None:
    spec = SamplingParams(json_schema=PERSON).structured
    assert spec == StructuredSpec("json", json.dumps(PERSON))
    structured = byte_llm.engine.structured
    assert structured.compiled(spec) is structured.compiled(spec)
    assert build_grammar(spec) is build_grammar(StructuredSpec("json", json.dumps(PERSON)))


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 3}, {"type": "string"}])
def test_json_strings_take_no_encoded_surrogates(schema: dict) -> None:
    """xgrammar alone takes ED A0 80 (an encoded surrogate) as one character; it decodes as three
    U+FFFD, past a maxLength. Our grammar refuses it and still takes real multi-byte text."""
    from model.loading.tokenizer import ByteTokenizer
    from model.sampling.structured import StructuredOutputs

    tok = ByteTokenizer()
    outputs = StructuredOutputs(tok, tok.vocab_size, [tok.eos_token_id])

    def accepts(raw: bytes) -> bool:
        constraint = outputs.constraint(SamplingParams(json_schema=schema))
        return all(constraint.accept(b) for b in raw) and constraint.accept(tok.eos_token_id)

    assert accepts('"é€"'.encode()) and accepts(b'"ab"')
    assert not accepts(b'"\xed\xa0\x80"') and not accepts(b'"a\xed\xbf\xbf"')
