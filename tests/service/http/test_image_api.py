"""Images through the HTTP APIs with the official `openai` and `anthropic` clients, unchanged, over
the real HTTP edge of a tiny random Qwen2-VL in this process (`EngineHost` + `build_api`, no Ray):
a chat request with images answers the tokens `LLM.generate` gives the same prompt and images
offline; streamed equals whole; the Messages and Responses APIs answer the same; every refusal is
a 400 in its API's error shape, naming what was wrong. The edge's rules alone (URLs, limits,
decoding) are tests/service/http/test_image_inputs.py."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from PIL import Image

from tests.support.in_process import edge_app
from tests.support.ingress_stub import stub_ingress
from model.loading.tokenizer import ByteTokenizer
from service.http.images import ImageLimits
from tests.support.tiny_models import one_thread  # noqa: F401 (one torch thread: the edge's engine and LLM compare exactly)
from tests.support.vision_models import random_image, save_tiny_qwen2_vl

MODEL = "tiny-vl"
MAX_MODEL_LEN = 160  # three 224x224 images (64 tokens each) do not fit; two smaller ones do
GREEDY = {"temperature": 0.0, "max_tokens": 12}
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension: a random model's early EOS would make short answers


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


PICTURE = random_image(1, 120, 90)
OTHER = random_image(2, 56, 112)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def llm(vl_dir: Path) -> Any:
    from model.llm import LLM

    return LLM(str(vl_dir), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=128)


@pytest.fixture(scope="module")
def engine(vl_dir: Path) -> Any:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    return build_engine(str(vl_dir), EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_model_len=MAX_MODEL_LEN),
                  device="cpu", dtype="float32")


def offline(vl_dir: Path, llm: Any, messages: list[dict[str, Any]], images: list[Image.Image],
            ignore_eos: bool = True) -> Any:
    """What `LLM.generate` answers for `messages` rendered by HF's own `apply_chat_template` (image
    parts as `{"type": "image"}`) and `images`: the reference the service must equal."""
    from transformers import AutoTokenizer

    from model.sampling.params import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(vl_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    return llm.generate({"prompt": ids, "multi_modal_data": {"image": images}},
                        SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=ignore_eos,
                                       logprobs=0))[0]


def logprobs(out: Any) -> list[float]:
    return [lp.logprob for lp in out.logprobs]


def same_logprobs(got: list[float], want: list[float]) -> bool:
    """Equal within what two engines of one process, on one thread, can differ by (nothing, in
    practice): far below what another image moves them by (see `test_..._offline_generate`)."""
    return len(got) == len(want) and all(abs(a - b) < 1e-5 for a, b in zip(got, want))


Check = Callable[[openai.AsyncOpenAI, anthropic.AsyncAnthropic, httpx.AsyncClient], Awaitable[None]]


def served(engine: Any, check: Check, limits: ImageLimits | None = None) -> None:
    """Run `check` with both official async clients (and plain httpx) over the edge serving `engine`."""

    async def run() -> None:
        async with edge_app(engine, MODEL, images=limits) as app, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=120) as http, \
                httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://edge", timeout=120) as http2:
            await check(openai.AsyncOpenAI(base_url="http://edge/v1", api_key="unused", http_client=http, max_retries=0),
                        anthropic.AsyncAnthropic(base_url="http://edge", api_key="unused", http_client=http2,
                                                 max_retries=0), http)

    asyncio.run(run())


def image_part(image: Image.Image, detail: str = "auto") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image), "detail": detail}}


# ---- answers equal the offline engine's -----------------------------------------------------------

def test_chat_with_images_equals_offline_generate_streamed_or_not(vl_dir: Path, llm: Any, engine: Any) -> None:
    one = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                        {"type": "image"}, {"type": "text", "text": " this picture?"}]}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                        {"type": "text", "text": ": which is brighter?"}]}]
    ref_one, ref_two = offline(vl_dir, llm, one, [PICTURE]), offline(vl_dir, llm, two, [PICTURE, OTHER])
    # The images (and their order) change the answer: its logprobs at least (a tiny random model's
    # greedy tokens may not move), so the comparisons below fail for an image lost on the way.
    swapped = offline(vl_dir, llm, two, [OTHER, PICTURE])
    assert max(abs(a - b) for a, b in zip(logprobs(swapped), logprobs(ref_two))) > 1e-3

    async def check(client: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic, http: httpx.AsyncClient) -> None:
        for ref, messages in ((ref_one, [{"role": "user", "content": [
                {"type": "text", "text": "What is in "}, image_part(PICTURE), {"type": "text", "text": " this picture?"}]}]),
                              (ref_two, [{"role": "user", "content": [
                                  image_part(PICTURE), {"type": "text", "text": "and"}, image_part(OTHER),
                                  {"type": "text", "text": ": which is brighter?"}]}])):
            resp = await client.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS,
                                                        logprobs=True, **GREEDY)
            assert resp.choices[0].message.content == ref.text
            assert same_logprobs([lp.logprob for lp in resp.choices[0].logprobs.content], logprobs(ref))
            # Usage counts each image's tokens, as vLLM does: the expanded prompt the engine ran.
            assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 12
            stream = await client.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS,
                                                          stream=True, stream_options={"include_usage": True},
                                                          logprobs=True, **GREEDY)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
            streamed = [lp.logprob for c in chunks if c.choices and c.choices[0].logprobs
                        for lp in c.choices[0].logprobs.content]
            assert same_logprobs(streamed, logprobs(ref))
            assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
            tokenized = (await http.post("/tokenize", json={"model": MODEL, "messages": messages})).json()
            assert tokenized["tokens"] == ref.prompt_token_ids

    served(engine, check)


def test_the_messages_and_responses_apis_answer_the_same(vl_dir: Path, llm: Any, engine: Any) -> None:
    """Neither API takes ignore_eos: the references stop at EOS too (these two images' answers do not
    reach it within 12 tokens, and differ, so an image lost on the way fails the comparison)."""
    pictures = [PICTURE, random_image(8, 200, 100)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    refs = [offline(vl_dir, llm, messages, [p], ignore_eos=False) for p in pictures]
    assert refs[0].text != refs[1].text and all(r.finish_reason == "length" for r in refs)

    async def check(client: openai.AsyncOpenAI, sdk: anthropic.AsyncAnthropic, _: httpx.AsyncClient) -> None:
        for picture, ref in zip(pictures, refs):
            b64 = base64.b64encode(png_bytes(picture)).decode()
            content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
                       {"type": "text", "text": "Describe."}]
            body = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": content}],
                    "extra_body": {"temperature": 0.0}}
            msg = await sdk.messages.create(**body)
            assert "".join(b.text for b in msg.content if b.type == "text") == ref.text.lstrip()
            # input_tokens + cache reads: the whole expanded prompt (a repeat reads blocks from the prefix cache)
            assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(ref.prompt_token_ids)
            count = await sdk.messages.count_tokens(model=MODEL, messages=body["messages"])
            assert count.input_tokens == len(ref.prompt_token_ids)
            async with sdk.messages.stream(**body) as stream:
                final = await stream.get_final_message()
            assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
            resp = await client.responses.create(model=MODEL, max_output_tokens=12, temperature=0.0, input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture), "detail": "auto"},
                                             {"type": "input_text", "text": "Describe."}]}])
            assert resp.output_text == ref.text and resp.usage.input_tokens == len(ref.prompt_token_ids)

    served(engine, check)


def test_a_file_url_under_the_allowed_directory_is_the_same_image(tmp_path: Path, vl_dir: Path, llm: Any,
                                                                  engine: Any) -> None:
    (tmp_path / "pic.png").write_bytes(png_bytes(PICTURE))
    ref = offline(vl_dir, llm, [{"role": "user", "content": [{"type": "image"}]}], [PICTURE])

    async def check(client: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic, __: httpx.AsyncClient) -> None:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/pic.png"}}]}]
        resp = await client.chat.completions.create(model=MODEL, messages=messages, extra_body=IGNORE_EOS, **GREEDY)
        assert resp.choices[0].message.content == ref.text

    served(engine, check, ImageLimits(allowed_local_media_path=str(tmp_path)))


def test_images_in_tool_results_reach_the_template(vl_dir: Path, llm: Any, engine: Any) -> None:
    """A tool's answer holding an image: an OpenAI tool message's image_url part, an Anthropic
    tool_result's image block (this template renders a tool message's parts like a user's)."""
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    history = [{"role": "user", "content": "Take a screenshot."},
               {"role": "assistant", "content": "Taking it.", "tool_calls": [call]}]
    ref = offline(vl_dir, llm, [*history, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "image"}]}],
                  [PICTURE], ignore_eos=False)
    assert ref.finish_reason == "length"
    b64 = base64.b64encode(png_bytes(PICTURE)).decode()

    async def check(client: openai.AsyncOpenAI, sdk: anthropic.AsyncAnthropic, _: httpx.AsyncClient) -> None:
        messages = [*history, {"role": "tool", "tool_call_id": "c1", "content": [image_part(PICTURE)]}]
        resp = await client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, **GREEDY)
        assert resp.choices[0].message.content == ref.text
        assert same_logprobs([lp.logprob for lp in resp.choices[0].logprobs.content], logprobs(ref))
        msg = await sdk.messages.create(model=MODEL, max_tokens=12, extra_body={"temperature": 0.0}, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "text", "text": "Taking it."},
                                              {"type": "tool_use", "id": "c1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]}])
        assert "".join(b.text for b in msg.content if b.type == "text") == ref.text.lstrip()

    served(engine, check)


# ---- refusals: 400s in each API's shape --------------------------------------------------------------

def _openai_400(caught: pytest.ExceptionInfo, code: str, *says: str) -> dict[str, Any]:
    err = caught.value
    assert isinstance(err, openai.BadRequestError) and err.status_code == 400
    body = err.body if "error" not in (err.body or {}) else err.body["error"]
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["type"] == "invalid_request_error" and body["code"] == code and body["param"], body
    assert all(s in body["message"] for s in says), body
    return body


def test_each_limit_is_a_400_naming_it(engine: Any) -> None:
    big = random_image(3, 300, 200)
    limits = ImageLimits(max_images=2, max_image_bytes=len(png_bytes(big)) - 1, max_image_pixels=250 * 200)

    async def check(client: openai.AsyncOpenAI, sdk: anthropic.AsyncAnthropic, http: httpx.AsyncClient) -> None:
        cases = [([image_part(PICTURE)] * 3, "too_many_images", ["3 images", "at most 2", "limit_mm_per_prompt"]),
                 ([image_part(big)], "image_too_large", ["max_image_bytes"]),
                 ([image_part(random_image(4, 260, 200).convert("L"))], "image_too_large",
                  ["260x200", "max_image_pixels"])]
        for content, code, says in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                     **GREEDY)
            _openai_400(caught, code, *says)
        blocks = [{"type": "image", "source": {"type": "url", "url": data_url(PICTURE)}}] * 3
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": blocks}])
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert "limit_mm_per_prompt" in body["error"]["message"] and body["error"]["message"].startswith("messages")
        r = await http.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(big)}]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert "max_image_bytes" in r.json()["error"]["message"] and r.json()["error"]["code"] == "image_too_large"

    served(engine, check, limits)


def test_what_cannot_be_read_is_a_400_never_a_500(tmp_path: Path, engine: Any) -> None:
    (tmp_path / "secret.png").write_bytes(png_bytes(PICTURE))
    allowed = tmp_path / "media"
    allowed.mkdir()
    broken = "data:image/png;base64," + base64.b64encode(png_bytes(PICTURE)[:100]).decode()

    async def check(client: openai.AsyncOpenAI, sdk: anthropic.AsyncAnthropic, http: httpx.AsyncClient) -> None:
        cases = [(broken, "invalid_image", "cannot be decoded"),
                 ("data:text/plain;base64,aGVsbG8=", "invalid_image_url", "text/plain"),
                 ("data:image/png;base64," + base64.b64encode(b"not a picture at all").decode(), "invalid_image",
                  "cannot be decoded"),
                 (f"file://{allowed}/../secret.png", "image_url_not_allowed", "allowed_local_media_path"),
                 ("https://example.com/cat.png", "image_url_not_allowed", "allowed_media_domains")]
        for url, code, says in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                    {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}]}], **GREEDY)
            body = _openai_400(caught, code, says)
            assert body["param"] == "messages[0].content[1].image_url"
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": broken.split(",", 1)[1]}}]}])
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert "cannot be decoded" in caught.value.body["error"]["message"]
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [
            image_part(PICTURE), {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>"}]}]})
        assert r.status_code == 400 and "place each image once" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [
            image_part(Image.new("RGB", (3000, 10)))]}]})  # Qwen2-VL's processor refuses an aspect ratio past 200
        assert r.status_code == 400 and "image processor cannot take" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "invalid_image"
        assert (await http.get("/health")).status_code == 200

    served(engine, check, ImageLimits(allowed_local_media_path=str(allowed)))


def test_the_expanded_prompt_counts_against_the_context(engine: Any) -> None:
    large = random_image(5, 224, 224)  # 64 tokens each (the checkpoint's max_pixels)

    async def check(client: openai.AsyncOpenAI, _: anthropic.AsyncAnthropic, __: httpx.AsyncClient) -> None:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                image_part(large), image_part(large), image_part(large)]}], max_tokens=1)
        assert "context" in str(caught.value) and str(MAX_MODEL_LEN) in str(caught.value)
        ok = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            image_part(large), image_part(large)]}], max_tokens=1)
        assert 128 < ok.usage.prompt_tokens < MAX_MODEL_LEN

    served(engine, check)


def test_a_text_model_refuses_images_with_a_400() -> None:
    client, engine, _ = stub_ingress(ByteTokenizer(), name="text-only")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, image_part(PICTURE)]}]})
    assert r.status_code == 400 and engine.calls == []
    assert r.json()["error"] == {"message": "messages[0].content[1].image_url: model 'text-only' does not take images "
                                            "(it has no vision encoder); send text only",
                                 "type": "invalid_request_error", "param": "messages[0].content[1].image_url",
                                 "code": "images_not_supported"}
    r = client.post("/v1/messages", json={"model": "text-only", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "does not take images" in r.json()["error"]["message"]
    r = client.post("/v1/attention", json={"messages": [{"role": "user", "content": [image_part(PICTURE)]}]})
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


# ---- through Ray Serve: the app arguments reach each replica's edge ---------------------------------

@pytest.mark.slow
def test_the_deployed_service_takes_images_within_its_arguments(vl_dir: Path, tmp_path: Path,
                                                                shared_serve: Any) -> None:
    (tmp_path / "pic.png").write_bytes(png_bytes(PICTURE))
    args = {"model": str(vl_dir), "served_model_name": MODEL, "max_num_seqs": 4, "num_kv_blocks": 128,
            "max_model_len": MAX_MODEL_LEN, "engine_num_cpus": 1, "limit_mm_per_prompt": {"image": 1},
            "allowed_local_media_path": str(tmp_path), "max_body_bytes": 4 << 20}
    with shared_serve(args) as url, httpx.Client(base_url=url, timeout=120) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/pic.png"}},
                                                 {"type": "text", "text": "Describe."}]}]
        resp = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        assert resp.usage.prompt_tokens == tokenized["count"] > 20 and resp.usage.completion_tokens > 0
        inline = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            image_part(PICTURE), {"type": "text", "text": "Describe."}]}], **GREEDY)
        assert inline.choices[0].message.content == resp.choices[0].message.content  # the same picture
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
                image_part(PICTURE), image_part(OTHER)]}], **GREEDY)
        _openai_400(caught, "too_many_images", "at most 1", "limit_mm_per_prompt")
