"""Tool-call formats and reasoning, without Ray: the parsers of every format on text (several
calls, text around them, every chunking of the stream, a call inside `<think>`, malformed text),
and `tool_choice` "auto" / "required" on a tiny random model at temperature 1 over many seeds,
where every call that comes back parses and validates against its tool's schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from service.tools.answer import AnswerParser, ReasoningEvent, plan_answer
from service.tools.formats import FORMATS, JsonCallFormat, detect_format, python_kwargs_ebnf
from service.tools.parser import ArgumentsEvent, CallStartEvent, TextEvent
from service.tools.reasoning import ReasoningMode, ReasoningSplitter, count_reasoning_tokens

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12},
                                           "exact": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                    "maxItems": 2}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "parameters": WEATHER}, {"name": "search", "parameters": SEARCH}]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}

# format -> (text with two calls, the content around them, the calls)
SAMPLES: dict[str, tuple[str, str, list[tuple[str, dict[str, Any]]]]] = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "a}\\"b{", "tags": ["x"]}}\n'
               '</tool_call>', "Let me check.\n",
               [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": 'a}"b{', "tags": ["x"]})]),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
                    '{"name": "search", "parameters": {"query": "q"}}', "",
                    [("get_weather", {"city": "Oslo", "days": 1}), ("search", {"query": "q"})]),
    "mistral": ('Sure [TOOL_CALLS][{"name": "search", "arguments": {"query": "[1]"}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris", "days": 7}}]', "Sure ",
                [("search", {"query": "[1]"}), ("get_weather", {"city": "Paris", "days": 7})]),
    "pythonic": ('[get_weather(city="Paris", days=3), search(query="it\'s (x)", exact=True, tags=[\'a\'])]', "",
                 [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "it's (x)", "exact": True,
                                                                             "tags": ["a"]})]),
}


def _read(events: list[Any]) -> tuple[str, list[tuple[str, str]], int]:
    """(content, [(name, arguments)], the number of CallStartEvents) from parser events."""
    text = "".join(e.text for e in events if isinstance(e, TextEvent))
    calls: dict[int, list[str]] = {}
    starts = 0
    for e in events:
        if isinstance(e, CallStartEvent):
            assert e.index not in calls, "a call started twice"
            calls[e.index] = [e.name, ""]
            starts += 1
        elif isinstance(e, ArgumentsEvent):
            calls[e.index][1] += e.text
    return text, [(n, a) for n, a in (calls[i] for i in sorted(calls))], starts


def _parse(fmt_name: str, text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, str]], int]:
    """Parse `text` whole (a finished answer), or streamed in pieces cut at `cuts`."""
    parser = FORMATS[fmt_name].parser()
    if cuts is None:
        return _read(parser.feed(text, final=True))
    events: list[Any] = []
    bounds = [0, *(cuts or []), len(text)]
    for lo, hi in zip(bounds, bounds[1:]):
        events += parser.feed(text[lo:hi])
    events += parser.feed("", final=True)
    return _read(events)


@pytest.mark.parametrize("fmt_name", sorted(SAMPLES))
def test_each_format_reads_its_calls_and_the_text_around_them(fmt_name: str) -> None:
    text, content, calls = SAMPLES[fmt_name]
    got_content, got_calls, starts = _parse(fmt_name, text)
    assert got_content == content and starts == len(calls)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


@pytest.mark.parametrize("fmt_name", sorted(SAMPLES))
def test_every_chunking_of_the_stream_gives_the_same_answer(fmt_name: str) -> None:
    """Cut once at every character, and into single characters: the same content and calls,
    each call started once, its argument pieces concatenating to the whole."""
    text = SAMPLES[fmt_name][0]
    whole = _parse(fmt_name, text)
    for k in range(len(text) + 1):
        assert _parse(fmt_name, text, [k]) == whole, k
    assert _parse(fmt_name, text, list(range(1, len(text)))) == whole


LLAMA_TAGGED = [
    ('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}', "", [("search", {"query": "q"})]),
    ('Checking. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}; '
     '{"name": "search", "parameters": {"query": "q"}}', "Checking. ",
     [("get_weather", {"city": "Oslo", "days": 1}), ("search", {"query": "q"})]),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_TAGGED)
def test_llama_calls_after_the_python_tag(text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    """Llama 3.1/3.2 write `<|python_tag|>` before a JSON call; the tag opens the call, whole or streamed."""
    whole = _parse("llama3_json", text)
    assert whole[0] == content and whole[2] == len(calls)
    assert [(n, json.loads(a)) for n, a in whole[1]] == calls
    for k in range(len(text) + 1):
        assert _parse("llama3_json", text, [k]) == whole, k
    assert _parse("llama3_json", text, list(range(1, len(text)))) == whole


def test_arguments_stream_as_they_are_written() -> None:
    parser = FORMATS["hermes"].parser()
    assert parser.feed("<tool_call>\n{\"name\": ") == []
    assert parser.feed('"search", "arguments": {"query"') == [CallStartEvent(0, "search"),
                                                              ArgumentsEvent(0, '{"query"')]
    assert parser.feed(': "x"}}\n</tool') == [ArgumentsEvent(0, ': "x"}')]
    assert parser.feed("_call>") == [] and parser.feed("", final=True) == []


@pytest.mark.parametrize("fmt_name, text", [
    ("hermes", "I use <tool_call> tags in prose, not JSON."),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "x"}\n</tool_call>'),  # not the format's key order
    ("hermes", '<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "unfinished'),
    ("llama3_json", '{"name": 3, "parameters": {}}'),
    ("llama3_json", "<|python_tag|> is how I would call a tool"),
    ("mistral", "[TOOL_CALLS] nothing here"),
    ("pythonic", "[1, 2, 3] is a list"),
    ("pythonic", "[search(query=open('x'))]"),
    ("pythonic", "Text first, then [search(query='q')]"),
])
def test_text_that_is_not_a_complete_call_stays_text(fmt_name: str, text: str) -> None:
    content, calls, starts = _parse(fmt_name, text)
    assert (content, calls, starts) == (text, [], 0)
    if "unfinished" not in text:  # streamed, the same (a call cut short was already sent in part)
        assert _parse(fmt_name, text, list(range(1, len(text)))) == (text, [], 0)


def test_a_streamed_call_cut_short_is_not_sent_again_as_text() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "unfini'
    content, calls, starts = _parse("hermes", text, list(range(1, len(text))))
    assert (content, calls, starts) == ("", [("search", '{"query": "unfini')], 1)


def test_a_call_inside_the_thinking_is_not_a_call() -> None:
    text = ('<think>\nMaybe <tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>?\n</think>\n\n'
            'Answer: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>')
    for cuts in ([], list(range(1, len(text)))):
        parser = AnswerParser(ReasoningMode(False, True), FORMATS["hermes"].parser())
        bounds = [0, *cuts, len(text)]
        events = [e for lo, hi in zip(bounds, bounds[1:]) for e in parser.feed(text[lo:hi])]
        events += parser.feed("", final=True)
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningEvent))
        assert reasoning == '\nMaybe <tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>?\n'
        content, calls, _ = _read(events)
        assert content == "Answer: " and calls == [("get_weather", '{"city": "Oslo", "days": 1}')]
        assert text[:parser.reasoning_chars].endswith("</think>")


@pytest.mark.parametrize("mode, text, reasoning, content", [
    (ReasoningMode(True, False), "deep thought</think>\n\nforty-two", "deep thought", "forty-two"),
    (ReasoningMode(True, False), "never closed", "never closed", ""),
    (ReasoningMode(False, True), "  <think>hm</think>ok", "hm", "ok"),
    (ReasoningMode(False, True), "no thinking <think>here</think>", "", "no thinking <think>here</think>"),
    (ReasoningMode(False, False), "<think>x</think>y", "", "<think>x</think>y"),
])
def test_reasoning_split(mode: ReasoningMode, text: str, reasoning: str, content: str) -> None:
    for step in (len(text) or 1, 1):
        splitter = ReasoningSplitter(mode)
        pieces = [p for i in range(0, len(text), step) for p in splitter.feed(text[i:i + step])]
        pieces += splitter.feed("", final=True)
        assert "".join(t for k, t in pieces if k == "reasoning") == reasoning
        assert "".join(t for k, t in pieces if k == "content") == content


def test_the_prompt_says_whether_the_answer_starts_thinking() -> None:
    assert ReasoningMode.of_prompt("<|im_start|>assistant\n<think>\n") == ReasoningMode(True, False)
    assert ReasoningMode.of_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ReasoningMode(False, False)
    assert ReasoningMode.of_prompt("<think>a</think>old turn<|im_start|>assistant\n") == ReasoningMode(False, True)


def test_reasoning_tokens_are_counted_from_the_token_bytes() -> None:
    class Bytes:
        pieces = {1: b"<think>", 2: b"ab", 3: b"c</th", 4: b"ink>", 5: b"\n\nok"}

        def id_to_bytes(self, i: int) -> bytes:
            return self.pieces[i]

    text = "<think>abc</think>\n\nok"
    splitter = ReasoningSplitter(ReasoningMode(False, True))
    splitter.feed(text, final=True)
    assert count_reasoning_tokens([1, 2, 3, 4, 5], splitter.reasoning_chars, Bytes()) == 4


def test_templates_name_their_format() -> None:
    assert detect_format("... <tool_call>\n{{ tool_call | tojson }}</tool_call>").name == "hermes"
    assert detect_format("[TOOL_CALLS] ...").name == "mistral"
    assert detect_format('{"name": function name, "parameters": ...} <|python_tag|>').name == "llama3_json"
    assert detect_format("[func_name1(params_name1=params_value1)] ipython \"parameters\"").name == "pythonic"
    assert detect_format("{{ messages }}") is None and detect_format(None) is None
    assert detect_format("<tool_call> and [TOOL_CALLS]") is None  # ambiguous: set tool_call_parser


def test_pythonic_needs_identifiers() -> None:
    with pytest.raises(ValueError, match="identifiers"):
        plan_answer([{"name": "get-weather", "parameters": WEATHER}], "auto", True, FORMATS["pythonic"], None)
    assert "p0_root" in python_kwargs_ebnf(WEATHER)


def test_forced_calls_without_a_model_format_are_plain_json() -> None:
    plan = plan_answer(TOOLS, "search", True, None, None)
    assert plan.constraint == {"json_schema": SEARCH} and isinstance(plan.tool_format, JsonCallFormat)
    content, calls, _ = _read(plan.parser().feed('{"query": "x"}', final=True))
    assert (content, calls) == ("", [("search", '{"query": "x"}')])
    assert plan_answer(TOOLS, "auto", True, None, None).constraint is None  # no format: a text answer
    assert plan_answer(TOOLS, "none", True, FORMATS["hermes"], None).constraint is None


# ---- on a model --------------------------------------------------------------------------------

# The trigger of each format as one token of the test tokenizer, so a logit bias can make a random
# model open calls; Mistral's is a special token, which the server reveals as text.
TRIGGER_TOKENS = {"hermes": ("<tool_call>", False), "mistral": ("[TOOL_CALLS]", True),
                  "llama3_json": ('{"name"', False), "pythonic": ("[", False)}
SEEDS = 24


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import AddedToken, Tokenizer

    from tests.support.chat_tokenizers import write_chat_tokenizer
    from model import LLM
    from model.config import EngineConfig
    from tests.support.tiny_models import write_tiny_llama

    directory: Path = tmp_path_factory.mktemp("tools") / "tiny"
    write_chat_tokenizer(directory, "qwen2.5", vocab_size=400)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_tokens([AddedToken('{"name"', special=False, normalized=False)])
    tok.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False),
                            AddedToken("<|python_tag|>", special=True, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    write_tiny_llama(directory, arch="qwen2", with_tokenizer=False, vocab_size=vocab, max_position_embeddings=512,
                     eos_token_id=tok.token_to_id("<|im_end|>"))
    llm = LLM(str(directory), device="cpu", engine_config=EngineConfig(kv_cache_memory_bytes=16 << 20))
    assert llm.tokenizer.reveal_special_tokens(["[TOOL_CALLS]", "<|python_tag|>"]) == ["[TOOL_CALLS]",
                                                                                       "<|python_tag|>"]
    return llm


def _check_answer(fmt_name: str, text: str, finish_reason: str, parallel: bool) -> int:
    """Parse one answer; every complete call validates. Returns the number of calls."""
    parser = FORMATS[fmt_name].parser()
    content, calls, _ = _read(parser.feed(text, final=True))
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if not parallel:
        assert len(calls) <= 1, text
    if finish_reason == "stop":  # a finished answer holds no broken call
        assert all(c.complete for c in parser.calls)
        assert TRIGGER_TOKENS[fmt_name][0] not in content or fmt_name == "pythonic", text
    return len(calls)


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("choice, parallel", [("auto", True), ("auto", False), ("required", True)])
def test_random_model_calls_always_parse_and_validate(llm: Any, fmt_name: str, choice: str, parallel: bool) -> None:
    from model import SamplingParams

    trigger = llm.tokenizer._tok.token_to_id(TRIGGER_TOKENS[fmt_name][0])
    plan = plan_answer(TOOLS, choice, parallel, FORMATS[fmt_name], None)
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, logit_bias={trigger: 4.0}, **plan.constraint)
              for seed in range(SEEDS)]
    prompt = llm.tokenizer.encode("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    outs = llm.generate([prompt] * SEEDS, params)
    counts = [_check_answer(fmt_name, o.text, o.finish_reason, parallel) for o in outs]
    assert sum(counts) > 0, "no seed called a tool"
    if choice == "required":
        finished = [n for n, o in zip(counts, outs) if o.finish_reason == "stop"]
        assert finished and all(n >= 1 for n in finished)


def test_a_llama_answer_that_writes_the_python_tag_goes_on_with_a_call(llm: Any) -> None:
    """Llama models write `<|python_tag|>` before a call: with the tag's token boosted, every answer
    that writes it goes on with a call valid against its tool's schema (it was text before: the tag
    did not open the constraint)."""
    from model import SamplingParams

    fmt = FORMATS["llama3_json"]
    tag = llm.tokenizer._tok.token_to_id(fmt.python_tag)
    plan = plan_answer(TOOLS, "auto", True, fmt, None)
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=seed, logit_bias={tag: 8.0}, **plan.constraint)
              for seed in range(8)]
    prompt = llm.tokenizer.encode("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    tagged = [o for o in llm.generate([prompt] * 8, params) if fmt.python_tag in o.text]
    assert len(tagged) >= 4, "the boosted tag was hardly written"
    complete = 0
    for out in tagged:
        parser = fmt.parser()
        content, _, _ = _read(parser.feed(out.text))  # as streamed: a call cut short by max_tokens has started
        assert parser.calls and fmt.python_tag not in content, out.text
        for call in parser.calls:
            if call.complete:
                complete += 1
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert complete, "no call completed within max_tokens"


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_every_plan_compiles(fmt_name: str) -> None:
    """Each tool choice, with and without thinking first, and auto with a response schema."""
    from model.sampling.params import SamplingParams
    from model.sampling.structured import check_structured

    for reasoning in (None, ReasoningMode(True, False), ReasoningMode(False, True)):
        for choice in ("auto", "required", "search"):
            for schema in (None, {"type": "object", "properties": {"answer": {"type": "string"}}}):
                plan = plan_answer(TOOLS, choice, True, FORMATS[fmt_name], reasoning, schema)
                assert plan.absorbs_response_format == (schema is not None and choice == "auto")
                check_structured(SamplingParams(**plan.constraint))


# ---- the HTTP edge's answers (a stub engine replays a fixed reply) ------------------------------

OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS]


def _edge(reply: str, template: str | None = None, **serving_args: Any) -> Any:
    from tests.support.ingress_stub import stub_ingress
    from model.loading.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    tok.chat_template = template
    client, engine, _ = stub_ingress(tok, max_model_len=4096, **serving_args)
    engine.reply = tok.encode(reply, add_special_tokens=False)
    return client


def _stream_events(client: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("fmt_name", sorted(SAMPLES))
def test_answers_and_streams_in_openai_shape(fmt_name: str) -> None:
    text, content, calls = SAMPLES[fmt_name]
    client = _edge(text, tool_call_parser=fmt_name)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": OPENAI_TOOLS, "max_tokens": 500}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == (content or None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == len(ids) and all(len(i) == 9 if fmt_name == "mistral" else i.startswith("call_")
                                             for i in ids)
    streamed_calls: dict[int, list[str]] = {}
    streamed_text, finish = "", None
    for chunk in _stream_events(client, body):
        (c,) = chunk["choices"]
        delta = c["delta"]
        assert len([k for k in ("content", "tool_calls", "reasoning_content") if delta.get(k)]) <= 1
        streamed_text += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            if tc["index"] not in streamed_calls:
                assert tc["type"] == "function" and tc["id"] and tc["function"]["arguments"] == ""
                streamed_calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                streamed_calls[tc["index"]][1] += tc["function"]["arguments"]
        finish = c["finish_reason"] or finish
    assert streamed_text == content and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in (streamed_calls[i] for i in sorted(streamed_calls))] == calls
    if fmt_name != "pythonic":  # JSON arguments stream as they are written, not whole at the end
        assert max(len(chunk_args) for chunk_args in _argument_pieces(client, body)) < 8


def _argument_pieces(client: Any, body: dict[str, Any]) -> list[str]:
    return [tc["function"]["arguments"] for chunk in _stream_events(client, body)
            for tc in chunk["choices"][0]["delta"].get("tool_calls") or [] if "id" not in tc]


def test_reasoning_fields_and_tokens_at_the_edge() -> None:
    client = _edge("<think>hmm, 2+2</think>\n\nIt is 4.", reasoning_parser="qwen3")
    body = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 100}
    out = client.post("/v1/chat/completions", json=body).json()
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "hmm, 2+2" and message["content"] == "It is 4."
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == len("<think>hmm, 2+2</think>")
    events = _stream_events(client, body | {"stream_options": {"include_usage": True}})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm, 2+2"
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == len("<think>hmm, 2+2</think>")


def test_a_model_without_a_format_answers_auto_in_text() -> None:
    client = _edge('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>',
                   tool_call_parser="none")
    out = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": OPENAI_TOOLS, "max_tokens": 100}).json()
    assert out["choices"][0]["message"]["content"].startswith("<tool_call>")
    assert out["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in out["choices"][0]["message"]
    assert client.get("/v1/models").json()["data"][0]["tool_call_parser"] is None


# DeepSeek-R1's style: the generation prompt opens the thinking, the answer starts inside it.
R1_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content.split('</think>')[-1] if m.content else '' }}"
               "{% endfor %}{% if add_generation_prompt %}<assistant><think>\n{% endif %}")


def test_an_answer_that_starts_inside_the_thinking() -> None:
    tools = OPENAI_TOOLS[:1]
    client = _edge('weigh it\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                   '{"city": "Oslo", "days": 1}}\n</tool_call>', template=R1_TEMPLATE, tool_call_parser="hermes")
    assert client.get("/v1/models").json()["data"][0]["reasoning_parser"] == "think"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 200}
    out = client.post("/v1/chat/completions", json=body).json()
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == "weigh it\n" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == len("weigh it\n</think>")


def test_the_app_offers_every_parser() -> None:
    import typing

    from service.app import AppArgs
    from service.tools.formats import PARSER_CHOICES
    from service.tools.reasoning import PARSER_CHOICES as REASONING_CHOICES

    assert typing.get_args(AppArgs.model_fields["tool_call_parser"].annotation) == PARSER_CHOICES
    assert typing.get_args(AppArgs.model_fields["reasoning_parser"].annotation) == REASONING_CHOICES
