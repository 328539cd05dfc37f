"""Chat prompts equal to HF transformers': the token ids the HTTP edge sends to the engine for
`/v1/chat/completions` (and returns from `/tokenize`) are exactly
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)` for
templates in the styles of Llama 3, Qwen2.5, Qwen3 and Mistral; completions follow the tokenizer's
post-processor as `tokenizer(text)` does. Tools and tool history: tests/model/loading/test_tool_history.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.chat_tokenizers import STYLES, write_chat_tokenizer
from tests.support.ingress_stub import stub_ingress
from model.loading.tokenizer import HFTokenizer
from tests.support.requirements import need_module

transformers = need_module("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": "What is 2+2? 猫"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello, how are you?"},
     {"role": "user", "content": "Fine, thanks."}],
]


@pytest.fixture(scope="module", params=sorted(STYLES))
def style_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, write_chat_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


def _hf_ids(hf: Any, messages: list[dict[str, Any]]) -> list[int]:
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_prompt_ids_equal_apply_chat_template(style_dir: tuple[str, Path]) -> None:
    style, directory = style_dir
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    client, engine, serving = stub_ingress(HFTokenizer(directory))
    assert not serving.chat_template.is_default
    for messages in CONVERSATIONS:
        want = _hf_ids(hf, messages)
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        (sub,) = engine.calls[-1]
        assert sub.prompt_token_ids == want, (style, hf.decode(want), hf.decode(sub.prompt_token_ids))
        assert r.json()["usage"]["prompt_tokens"] == len(want)
        tokenized = client.post("/tokenize", json={"messages": messages}).json()
        assert tokenized["tokens"] == want
    if STYLES[style]["bos"]:  # the template writes BOS and the post-processor would too: once only
        assert want.count(hf.bos_token_id) == 1


def test_completion_prompts_follow_the_post_processor(style_dir: tuple[str, Path]) -> None:
    style, directory = style_dir
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    client, engine, _ = stub_ingress(HFTokenizer(directory))
    text = "Hello, how are you today?"
    want = hf(text)["input_ids"]
    assert (want[0] == hf.bos_token_id) == STYLES[style]["prepend_bos"]
    assert client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).status_code == 200
    assert engine.calls[-1][0].prompt_token_ids == want
    assert client.post("/tokenize", json={"prompt": text}).json()["tokens"] == want


def test_templates_get_the_tokenizers_bos_and_eos_strings(style_dir: tuple[str, Path], tmp_path: Path) -> None:
    """One source: the strings of tokenizer_config.json, as transformers passes them (the edge
    used to decode the EOS id, which gives "" for a special token, and passed no BOS)."""
    style, directory = style_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert (tok.bos_token, tok.eos_token) == (STYLES[style]["bos"], STYLES[style]["eos"])
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    client, _, _ = stub_ingress(tok)
    messages = CONVERSATIONS[1]
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids == _hf_ids(hf, messages)
    assert ids.count(hf.eos_token_id) == len(messages)
