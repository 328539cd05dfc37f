"""Attention over an image's patches: `POST /v1/attention` with an image in the messages equals the
offline engine's maps and says where the image's patch grid sits among the keys, and the explorer
page (headless Chromium, over the replica's edge served by uvicorn on loopback) shades the patches
of the chosen query token by its weights."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.in_process import edge_app
from tests.support.tiny_models import one_thread  # noqa: F401 (one torch thread: the edge's engine and LLM compare exactly)
from tests.support.vision_models import QWEN2_VL_IDS, random_image, save_tiny_qwen2_vl

pytestmark = pytest.mark.slow  # starts Ray Serve or a browser

MODEL = "tiny-vl"
CHROMIUM = "/usr/bin/chromium"
PICTURE = random_image(7, 112, 84)  # 112 wide, 84 high: 8x6 patches of 14, merged 2x2: 3 rows x 4 columns of tokens


def png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def messages() -> list[dict[str, Any]]:
    url = "data:image/png;base64," + base64.b64encode(png(PICTURE)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def base_url(vl_dir: Path) -> Iterator[str]:
    """The replica's HTTP edge over a real engine, served by uvicorn on a free loopback port."""
    import uvicorn

    from model.config import EngineConfig
    from model.engine.builder import build_engine

    engine = build_engine(str(vl_dir), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu", dtype="float32")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()

    async def main() -> None:
        async with edge_app(engine, MODEL) as app:
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.05)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            server.should_exit = True
            await task

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(60), "the edge did not start"
    yield f"http://127.0.0.1:{port}"
    stop.set()
    thread.join(30)


def test_attention_api_over_an_image_equals_offline(vl_dir: Path, base_url: str) -> None:
    from model.llm import LLM

    body = httpx.post(f"{base_url}/v1/attention", json={"model": MODEL, "messages": messages(), "layers": [1],
                                                        "rows": "last"}, timeout=120).json()
    pad = QWEN2_VL_IDS["image_pad"]
    (image,) = body["images"]
    ids = body["token_ids"]
    assert image["rows"] * image["cols"] == image["length"] == 12
    assert ids[image["offset"]:image["offset"] + image["length"]] == [pad] * 12
    assert ids[image["offset"] - 1] == QWEN2_VL_IDS["vision_start"]
    # Offline: the same prompt with one placeholder, the same picture.
    prompt = ids[:image["offset"] + 1] + ids[image["offset"] + image["length"]:]
    maps = LLM(str(vl_dir), dtype="float32").attention_maps(
        {"prompt": prompt, "multi_modal_data": {"image": PICTURE}}, layers=[1], rows="last")
    assert maps.token_ids == ids and maps.images == [(image["offset"], 12, 3, 4)]
    torch.testing.assert_close(torch.tensor(body["attention"]), maps.weights, atol=1e-6, rtol=0)
    # A prompt without images has no `images` field.
    text = httpx.post(f"{base_url}/v1/attention", json={"model": MODEL, "prompt": "no image"}, timeout=60).json()
    assert "images" not in text


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def test_explorer_shades_the_patches_a_token_attends_to(base_url: str, browser: Any, tmp_path: Path) -> None:
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(PICTURE))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{base_url}/explorer")
    page.wait_for_function("document.getElementById('model-info').textContent.length > 0")
    page.check("input[name=mode][value=chat]")
    page.set_input_files("#image", str(picture))
    page.wait_for_function("state.image !== null")
    page.fill("#prompt", "user: What is in the picture?")
    page.click("#run")
    page.wait_for_selector("#patch-maps canvas")
    assert not page.locator("#patches").is_hidden()
    page.select_option("#layer", "1")
    page.select_option("#head", "2")
    caption = page.locator("#patch-maps figcaption").inner_text()
    canvas = page.locator("#patch-maps canvas")
    size = canvas.evaluate("c => [c.width, c.height]")
    api = httpx.post(f"{base_url}/v1/attention", json={"model": MODEL, "messages": messages()}, timeout=120).json()
    (image,) = api["images"]
    row = api["attention"][1][2][-1]  # the last query token, layer 1, head 2
    share = 100 * sum(row[image["offset"]:image["offset"] + image["length"]])
    assert "(3x4 patches)" in caption
    assert abs(float(caption.split("patches): ")[1].split("%")[0]) - share) < 0.051
    cell = max(8, 320 // 4)
    assert size == [4 * cell, 3 * cell]
    # The most attended patch is the reddest one drawn over the picture.
    weights = row[image["offset"]:image["offset"] + image["length"]]
    top = max(range(12), key=weights.__getitem__)
    low = min(range(12), key=weights.__getitem__)
    red = canvas.evaluate(f"""c => [{top}, {low}].map(p => {{
        const d = c.getContext('2d').getImageData((p % 4) * {cell} + {cell} / 2, Math.floor(p / 4) * {cell} + {cell} / 2, 1, 1).data;
        return d[0] - (d[1] + d[2]) / 2; }})""")
    assert red[0] > red[1]
    page.close()
