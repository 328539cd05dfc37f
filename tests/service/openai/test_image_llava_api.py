"""LLaVA through the HTTP edge with the official `openai` client, its chat template only in the
processor's chat_template.json (as llava-hf ships it): a chat with an image equals the offline
engine on HF's rendering of the same messages, and `/v1/attention` over the image says
where its 4x4 patch grid sits (CLIP's class token dropped) with the offline maps' weights."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.support.in_process import edge_app
from tests.support.tiny_models import one_thread  # noqa: F401 (one torch thread: the edge's engine and LLM compare exactly)
from tests.support.vision_llava_models import IMAGE_TOKEN_ID, random_image, save_tiny_llava

MODEL = "tiny-llava"
PICTURE = random_image(3, 40, 33)
# LLaVA-1.5's conversation shape: "USER: <image>\n... ASSISTANT:"; image parts write the placeholder.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER: {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>\n"
            "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} "
            "{% else %}ASSISTANT: {{ m['content'] }}<|endoftext|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def data_url(image: Any) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PICTURE)}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = save_tiny_llava(tmp_path_factory.mktemp("llava"), "clip-layer-2-default")
    # As llava-hf ships it: the template only in the processor's chat_template.json.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def hf_prompt(directory: Path) -> list[int]:
    """HF's own rendering of MESSAGES (image parts as {"type": "image"}), one placeholder per image."""
    from transformers import AutoTokenizer

    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    tok = AutoTokenizer.from_pretrained(str(directory))
    text = tok.apply_chat_template(hf_messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_chat_and_attention_over_an_image_equal_the_offline_engine(llava_dir: Path) -> None:
    from model.config import EngineConfig
    from model.engine.builder import build_engine
    from model.llm import LLM
    from model.sampling.params import SamplingParams

    prompt = hf_prompt(llava_dir)
    assert prompt.count(IMAGE_TOKEN_ID) == 1
    offline = LLM(str(llava_dir), dtype="float32")
    want = offline.generate({"prompt": prompt, "multi_modal_data": {"image": PICTURE}},
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    maps = offline.attention_maps({"prompt": prompt, "multi_modal_data": {"image": PICTURE}}, layers=[1], rows="last")
    engine = build_engine(str(llava_dir), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu", dtype="float32")

    async def run() -> tuple[Any, dict[str, Any]]:
        async with edge_app(engine, MODEL) as app, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=120) as http:
            client = openai.AsyncOpenAI(base_url="http://edge/v1", api_key="unused", http_client=http, max_retries=0)
            chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                                        logprobs=True, extra_body={"ignore_eos": True})
            body = (await http.post("/v1/attention", json={"model": MODEL, "messages": MESSAGES, "layers": [1],
                                                           "rows": "last"})).json()
            return chat, body

    chat, body = asyncio.run(run())
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids) == len(prompt) + 15  # one <image> -> 16 tokens
    assert [lp.logprob for lp in chat.choices[0].logprobs.content] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-5)
    assert chat.choices[0].message.content == want.text
    offset = want.prompt_token_ids.index(IMAGE_TOKEN_ID)
    assert body["images"] == [{"offset": offset, "length": 16, "rows": 4, "cols": 4}]
    assert maps.images == [(offset, 16, 4, 4)]
    torch.testing.assert_close(torch.tensor(body["attention"]), maps.weights, atol=1e-6, rtol=0)
