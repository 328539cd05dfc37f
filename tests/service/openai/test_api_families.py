"""The four generation endpoints are one engine path: for the same conversation, greedy text
is equal from /v1/completions (the chat prompt's ids), /v1/chat/completions, /v1/responses and
/v1/messages, stream and not, with the official clients over a real engine in this process."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.chat_tokenizers import generation_eos_ids, write_chat_tokenizer
from tests.support.in_process import edge_app
from tests.support.tiny_models import write_tiny_llama

MODEL = "tiny-qwen2"
SYSTEM = "Be brief."
QUESTION = "The cat sat on the"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tokenizers import Tokenizer

    from model.config import EngineConfig
    from model.engine.builder import build_engine

    directory = tmp_path_factory.mktemp("families") / "tiny"
    write_chat_tokenizer(directory, "qwen2.5", vocab_size=400)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    write_tiny_llama(directory, arch="qwen2", with_tokenizer=False, vocab_size=tok.get_vocab_size(True),
                     max_position_embeddings=512, eos_token_id=tok.token_to_id("<|im_end|>"))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos_ids(directory,
                                                                                                    "qwen2.5")}))
    return build_engine(str(directory), EngineConfig(num_kv_blocks=128, max_num_seqs=4), device="cpu", dtype="float32")


async def _texts(app: Any) -> dict[str, str]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=120) as http:
        oai = openai.AsyncOpenAI(base_url="http://edge/v1", api_key="unused", http_client=http, max_retries=0)
        ids = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        out: dict[str, str] = {}
        out["completions"] = (await oai.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                                           temperature=0)).choices[0].text
        out["chat"] = (await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0)).choices[0].message.content
        stream = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True)
        out["chat, streamed"] = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        response = await oai.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION,
                                              max_output_tokens=MAX_TOKENS, temperature=0)
        out["responses"] = response.output_text
        async with oai.responses.stream(model=MODEL, instructions=SYSTEM, input=QUESTION,
                                        max_output_tokens=MAX_TOKENS, temperature=0) as events:
            out["responses, streamed"] = "".join([e.delta async for e in events if e.type == "response.output_text.delta"])
    async with _anthropic_http(app) as http:
        ant = anthropic.AsyncAnthropic(base_url="http://edge", api_key="unused", max_retries=0, http_client=http)
        msg = await ant.messages.create(model=MODEL, system=SYSTEM, max_tokens=MAX_TOKENS,
                                        messages=[{"role": "user", "content": QUESTION}],
                                        extra_body={"temperature": 0})
        out["messages"] = "".join(b.text for b in msg.content if b.type == "text")
        async with ant.messages.stream(model=MODEL, system=SYSTEM, max_tokens=MAX_TOKENS,
                                       messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"temperature": 0}) as stream:
            out["messages, streamed"] = "".join([t async for t in stream.text_stream])
    return out


def _anthropic_http(app: Any) -> Any:
    import httpx2  # the anthropic SDK's HTTP library

    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://edge", timeout=120)


def test_greedy_text_is_equal_across_the_four_generation_endpoints(engine: Any) -> None:
    async def run() -> dict[str, str]:
        async with edge_app(engine, MODEL) as app:
            return await _texts(app)

    texts = asyncio.run(run())
    assert texts["completions"], texts
    assert all(t == texts["completions"] for t in texts.values()), texts
