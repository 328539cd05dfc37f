"""`POST /v1/attention` and the explorer page end to end: one Serve instance of the paper's
Transformer (the trained default, transformer-base-trained, d_k = 64) with an API key; the page
driven in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.local_serve import SharedServe
from model import LLM, SamplingParams
from model.config import EngineConfig
from service.explorer.attention_api import display_tokens
from tests.support.requirements import in_ci
from tests.support.tiny_models import torch_threads
from tests.support.paths import REPO

pytestmark = pytest.mark.slow  # starts Ray Serve or a browser

API_KEY = "explorer-test-key"
MODEL = "transformer-base-trained"  # the default model: its heads learned something to show
MAX_FLOATS = 200_000
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = "The cat sat. 猫🙂"
DOCS_SCREENSHOT = REPO / "docs" / "explorer.png"
REPLICA_THREADS = 1  # the engine replica's torch threads; offline references use as many


@pytest.fixture(scope="module")
def base_url(shared_serve: SharedServe) -> Iterator[str]:
    args = {"model": MODEL, "api_key": API_KEY, "max_num_seqs": 8, "num_kv_blocks": 128, "engine_num_cpus": 1,
            "torch_threads": REPLICA_THREADS, "dtype": "float32", "max_attention_floats": MAX_FLOATS}
    with shared_serve(args) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, dtype="float32", engine_config=EngineConfig(num_kv_blocks=64, max_num_seqs=4))


def test_attention_api_equals_offline(http: httpx.Client, offline: LLM) -> None:
    r = http.post("/v1/attention", json={"prompt": PROMPT, "layers": [0, 5], "heads": [1, 6], "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = offline.tokenizer.encode(PROMPT)
    with torch_threads(REPLICA_THREADS):  # the replica's thread count: the same float32 sums
        gen = offline.generate([ids], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids
        ref = offline.attention(ids + gen, layers=[0, 5], heads=[1, 6])
    assert body["token_ids"] == ids + gen
    n = len(ids) + 2
    assert (body["attention_kind"], body["num_layers"], body["num_heads"]) == ("dot", 6, 8)
    assert "num_kv_heads" not in body  # no grouped-query attention here
    assert body["layers"] == [0, 5] and body["heads"] == [1, 6] and body["rows"] == list(range(n))
    weights = torch.tensor(body["attention"])
    assert weights.shape == (2, 2, n, n)
    # Two processes: the same thread count, and still a tolerance for what may differ between
    # them (memory alignment can change a kernel's path); a wrong weight is off by far more than 1e-6.
    torch.testing.assert_close(weights, ref, atol=1e-6, rtol=0)
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5) and (weights.triu(1) == 0).all()
    assert len(body["score_std"]) == 2 and len(body["entropy"][0]) == 2
    # Tokens read as text: the byte tokenizer splits 猫 and 🙂 into bytes; each shows in the byte
    # that completes it, the bytes before it as escapes.
    assert "".join(re.sub(r"\\x[0-9a-f]{2}", "", t) for t in body["tokens"][:len(ids)]) == PROMPT
    assert body["tokens"][len(ids) - 1] == "🙂" and body["tokens"][len(ids) - 2] == "\\x99"


def test_scale_none_and_rows_last(http: httpx.Client) -> None:
    common = {"prompt": PROMPT, "rows": "last"}
    scaled = http.post("/v1/attention", json=common).json()
    unscaled = http.post("/v1/attention", json=common | {"scale": "none"}).json()
    assert scaled["rows"] == [len(scaled["token_ids"]) - 1]
    ratio = torch.tensor(unscaled["score_std"]) / torch.tensor(scaled["score_std"])
    torch.testing.assert_close(ratio, torch.full_like(ratio, 8.0))  # sqrt(d_k), d_k = 64
    assert torch.tensor(unscaled["attention"]).amax(-1).mean() > torch.tensor(scaled["attention"]).amax(-1).mean()


def test_chat_messages_use_the_chat_template(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi 猫"}]
    want = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = http.post("/v1/attention", json={"messages": messages, "rows": "last", "heads": [0]}).json()
    assert body["token_ids"] == want and body["rows"] == [len(want) - 1]
    assert torch.tensor(body["attention"]).shape == (6, 1, 1, len(want))


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x" * 80}, "layers", f"limit is {MAX_FLOATS}"),
    ({"prompt": "hi", "scale": "cosine"}, "scale", "sqrt_dk"),
    ({"prompt": "hi", "layers": [6]}, "layers", "[0, 5]"),
    ({"prompt": "hi", "rows": [7]}, "rows", "[0, 1]"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, None, "exactly one of prompt or messages"),
    ({"prompt": "hi", "temperature": 1.0}, "temperature", ""),
])
def test_bad_requests_are_400s(http: httpx.Client, body: dict, param: str | None, words: str) -> None:
    r = http.post("/v1/attention", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"]


def test_auth_and_page_files(base_url: str, http: httpx.Client) -> None:
    assert httpx.post(f"{base_url}/v1/attention", json={"prompt": "hi"}).status_code == 401
    page = httpx.get(f"{base_url}/explorer")  # the page itself needs no key: it asks for one
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert API_KEY not in page.text and "http://" not in page.text and "https://" not in page.text
    js = httpx.get(f"{base_url}/explorer/explorer.js")
    assert js.status_code == 200 and "https://" not in js.text and "http://www.w3.org/2000/svg" in js.text
    assert http.get("/explorer/secrets.txt").status_code == 404


def test_neighbours_unchanged_beside_attention_requests(http: httpx.Client) -> None:
    prompts = ["Once upon a time", "Attention is all you need", "q k v"]

    def complete(prompt: str) -> list[str]:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        attn = [pool.submit(http.post, "/v1/attention", json={"prompt": p, "max_tokens": 3}) for p in prompts]
        beside = [pool.submit(complete, p) for p in prompts]
        assert [f.result() for f in beside] == alone
        assert all(f.result().status_code == 200 for f in attn)


def test_display_tokens_of_a_bpe_tokenizer(tmp_path: Path) -> None:
    from model.loading.tokenizer import load_tokenizer
    from tests.support.tiny_models import save_tiny_gpt2

    tok = load_tokenizer(save_tiny_gpt2(tmp_path), 301)
    text = "Der Hund 猫🙂 ✨!"
    shown = display_tokens(tok, tok.encode(text))
    assert "".join(re.sub(r"\\x[0-9a-f]{2}", "", s) for s in shown) == text
    assert display_tokens(tok, [0]) == ["<eos>"]


# ---- the page in a real browser -------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not Path(CHROMIUM).exists():
        if in_ci():
            pytest.fail(f"{CHROMIUM} is missing (apt-get install chromium; .ci/run does)")
        pytest.skip(f"{CHROMIUM} is missing")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_explorer_page_in_chromium(base_url: str, http: httpx.Client, browser: object,
                                   tmp_path: Path) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{base_url}/explorer")
    page.wait_for_selector("#key-box:not([hidden])")  # the server has a key: the page asks for it
    page.fill("#api-key", API_KEY)
    page.click("#key-save")
    page.wait_for_function("document.getElementById('model-info').textContent.length > 0")
    page.fill("#prompt", PROMPT)
    page.click("#run")
    page.wait_for_selector("#map-scaled rect.cell")
    api = http.post("/v1/attention", json={"prompt": PROMPT}).json()
    n = len(api["tokens"])
    assert page.locator("#map-scaled rect.cell").count() == n * n  # one cell per (row, key)
    assert page.locator("#grid canvas").count() == 6 * 8
    page.select_option("#layer", "3")
    page.select_option("#head", "5")
    cell = page.locator(f"#map-scaled rect.cell[data-row='{n - 1}'][data-key='2']")
    cell.hover()
    tip = page.locator("#tooltip").inner_text()
    assert float(tip.rsplit("weight ", 1)[1]) == api["attention"][3][5][n - 1][2]
    assert api["tokens"][2] in tip or "\u2423" in tip
    page.check("#compare")
    page.wait_for_selector("#map-unscaled rect.cell")
    unscaled = http.post("/v1/attention", json={"prompt": PROMPT, "scale": "none"}).json()
    page.locator(f"#map-unscaled rect.cell[data-row='{n - 1}'][data-key='2']").hover()
    tip2 = page.locator("#tooltip").inner_text()
    assert float(tip2.rsplit("weight ", 1)[1]) == unscaled["attention"][3][5][n - 1][2] != float(
        tip.rsplit("weight ", 1)[1])
    assert "without 1/" in page.inner_text("#cap-unscaled") and "score std" in page.inner_text("#cap-scaled")
    page.mouse.move(0, 0)
    page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
    if os.environ.get("QKV_WRITE_DOCS_SCREENSHOT"):
        shutil.copy(tmp_path / "explorer.png", DOCS_SCREENSHOT)
    page.close()
