"""`POST /v1/embeddings`: vectors equal sentence-transformers' for the same checkpoint (last-token
and mean pooling, Normalize; a Qwen3Model and a Qwen3ForCausalLM checkpoint), the official
`openai` client against the running service (float, base64, lists, token ids, usage, alongside
a generation), Matryoshka `dimensions`, and 400s that name the field."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from model.config import EngineConfig
from model.engine.builder import build_engine
from model.engine.embedder import shorten
from model.engine.engine import Engine
from model.loading.pooling_config import PoolingConfig, read_pooling_config
from model.sampling.request_checks import RequestError
from tests.support.in_process import edge_app
from tests.support.requirements import need_module
from tests.support.tiny_models import EOS_TOKEN, build_tokenizer, torch_threads, write_tiny_llama

st = need_module("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer  # noqa: E402

from tests.support.local_serve import SharedServe  # noqa: E402

VOCAB, HIDDEN = 301, 64
TEXTS = ["The cat sat on the mat.", "hello", "Embeddings are vectors of one length for texts of any length."]
ST_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize")


def _hf_checkpoint(directory: Path) -> Path:
    """A tiny random Qwen3ForCausalLM (untied head) with a fast tokenizer transformers can load."""
    from transformers import PreTrainedTokenizerFast

    write_tiny_llama(directory, arch="qwen3", with_tokenizer=False, vocab_size=VOCAB, max_position_embeddings=256)
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(VOCAB), eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    tok.save_pretrained(directory)
    return directory


def _st_model(hf_dir: Path, out: Path, mode: str, normalize: bool) -> Path:
    """A sentence-transformers model (Transformer + Pooling(mode) [+ Normalize]) saved to `out`:
    a Qwen3Model checkpoint (no lm_head, bare names) with modules.json and 1_Pooling/config.json."""
    modules = [Transformer(str(hf_dir)), Pooling(HIDDEN, mode)] + ([Normalize()] if normalize else [])
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_checkpoint(tmp_path_factory.mktemp("qwen3-causal"))


@pytest.fixture(scope="module")
def last_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _st_model(hf_dir, tmp_path_factory.mktemp("qwen3-st-last"), "lasttoken", normalize=True)


def _reference(directory: Path, texts: list[str]) -> torch.Tensor:
    with torch_threads(1):
        return SentenceTransformer(str(directory), device="cpu").encode(texts, convert_to_tensor=True).float()


def _ours(directory: Path, texts: list[str]) -> torch.Tensor:
    engine = build_engine(str(directory), EngineConfig(num_kv_blocks=16), device="cpu", dtype="float32")
    ids = [engine.tokenizer.encode(t, True) for t in texts]
    return torch.stack(engine.embedder.embed(ids))


# ---- parity with sentence-transformers --------------------------------------------------


@pytest.mark.parametrize("mode,normalize", [("lasttoken", True), ("mean", False), ("mean", True), ("cls", True)])
def test_vectors_equal_sentence_transformers(hf_dir: Path, tmp_path: Path, mode: str, normalize: bool) -> None:
    directory = _st_model(hf_dir, tmp_path / "st", mode, normalize)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    ours, ref = _ours(directory, TEXTS), _reference(directory, TEXTS)
    assert ours.shape == ref.shape == (len(TEXTS), HIDDEN)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert not torch.allclose(ours[0], ours[1], atol=1e-2)  # the texts do get different vectors


def test_causal_lm_checkpoint_with_pooling_files_matches(hf_dir: Path, last_dir: Path, tmp_path: Path) -> None:
    """A Qwen3ForCausalLM directory (lm_head stored, `model.` names) with the same pooling files."""
    directory = tmp_path / "causal"
    shutil.copytree(hf_dir, directory)
    for name in ST_FILES:
        src = last_dir / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, directory / name)
    assert json.loads((directory / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    torch.testing.assert_close(_ours(directory, TEXTS), _reference(last_dir, TEXTS), atol=1e-4, rtol=0)


def test_without_modules_json_the_default_is_sentence_transformers_own(hf_dir: Path, tmp_path: Path) -> None:
    """A *ForCausalLM checkpoint: last token, not normalized; any other architecture: mean."""
    assert read_pooling_config(hf_dir, HIDDEN) == PoolingConfig("lasttoken", False, HIDDEN)
    torch.testing.assert_close(_ours(hf_dir, TEXTS), _reference(hf_dir, TEXTS), atol=1e-4, rtol=0)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"]}))
    assert read_pooling_config(tmp_path, HIDDEN) == PoolingConfig("mean", False, HIDDEN)


def test_gpt2_checkpoint_embeds_with_mean_pooling_like_transformers(tmp_path: Path) -> None:
    """Another family falls out: GPT2LMHeadModel has no modules.json, so mean over its final
    hidden states (sentence-transformers' default for a non-*ForCausalLM architecture)."""
    from tests.support.tiny_models import build_tiny_gpt2, save_tiny_gpt2

    save_tiny_gpt2(tmp_path)
    hf = build_tiny_gpt2()
    prompts = [[5, 17, 33, 2], [250, 9], list(range(40, 90))]
    with torch.no_grad():
        want = torch.stack([hf.transformer(torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts])
    engine = build_engine(str(tmp_path), EngineConfig(num_kv_blocks=16), device="cpu", dtype="float32")
    assert engine.embedder.pooling == PoolingConfig("mean", False, HIDDEN)
    torch.testing.assert_close(torch.stack(engine.embedder.embed(prompts)), want, atol=1e-4, rtol=0)


def test_matryoshka_dimensions_truncate_and_renormalize(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32, 64]}))
    cfg = read_pooling_config(tmp_path, HIDDEN)
    assert cfg.matryoshka == (16, 32, 64) and cfg.check_dimensions(32) == 32 and cfg.check_dimensions(None) == 64
    with pytest.raises(RequestError, match="one of 16, 32, 64"):
        cfg.check_dimensions(20)
    with pytest.raises(RequestError, match="between 1 and"):
        cfg.check_dimensions(65)
    with pytest.raises(RequestError, match="does not support dimensions"):
        PoolingConfig("mean", True, HIDDEN).check_dimensions(16)
    v = torch.nn.functional.normalize(torch.arange(1.0, 9.0), dim=0)
    short = shorten(v, 4, normalize=True)
    torch.testing.assert_close(short, torch.nn.functional.normalize(torch.arange(1.0, 5.0), dim=0))
    torch.testing.assert_close(shorten(v, 4, normalize=False), v[:4])


def test_unsupported_module_is_reported(last_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "dense"
    shutil.copytree(last_dir, directory)
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (directory / "modules.json").write_text(json.dumps(modules))
    assert "Dense" in (read_pooling_config(directory, HIDDEN).unsupported or "")


# ---- the HTTP edge over a real engine in this process (no Ray) --------------------------


def _edge(directory: Path, body_limit: int = 1 << 20, capacity: int = -1, api_key: str | None = None) -> Any:
    """An async context: (httpx client of the replica's app over a real EngineHost, engine)."""
    from service.http.engine_call import OverloadPolicy
    from service.server.api import IngressSettings

    engine = build_engine(str(directory), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu", dtype="float32")

    class _Ctx:
        async def __aenter__(self) -> tuple[httpx.AsyncClient, Engine]:
            settings = IngressSettings(api_key=api_key, max_body_bytes=body_limit, admission_capacity=capacity)
            self.edge = edge_app(engine, "tiny-embed", settings, OverloadPolicy(capacity=capacity))
            app = await self.edge.__aenter__()
            self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=60)
            self.client.app = app  # type: ignore[attr-defined]  # its state.host: the metrics
            return self.client, engine

        async def __aexit__(self, *exc: Any) -> None:
            await self.client.aclose()
            await self.edge.__aexit__(*exc)

    return _Ctx()


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"]
    return err["message"]


def test_edge_answers_concurrent_requests_like_sentence_transformers(last_dir: Path) -> None:
    ref = _reference(last_dir, TEXTS)

    async def run() -> None:
        async with _edge(last_dir) as (http, _):
            bodies = [{"input": t} for t in TEXTS]
            answers = await asyncio.gather(*(http.post("/v1/embeddings", json=b) for b in bodies))
            for i, r in enumerate(answers):
                assert r.status_code == 200, r.text
                got = torch.tensor(r.json()["data"][0]["embedding"])
                torch.testing.assert_close(got, ref[i], atol=1e-4, rtol=0)
            counted = sum(r.json()["usage"]["prompt_tokens"] for r in answers)
            assert http.app.state.host.metrics.embedded_tokens == counted  # the prompt-token metric

    asyncio.run(run())


def test_batcher_runs_queued_requests_together_within_the_token_budget() -> None:
    """Requests queued before a gap between steps share its forward pass, up to
    `max_batch_tokens` tokens; the rest waits for the next gap; a cancelled request is skipped."""
    from service.openai.embeddings import EmbeddingBatcher, _Job

    class FakeEmbedder:
        max_batch_tokens = 5

        def __init__(self) -> None:
            self.calls: list[list[int]] = []

        def embed(self, prompts: list[list[int]], dims: list[int]) -> list[torch.Tensor]:
            self.calls.append([len(p) for p in prompts])
            return [torch.full((dims[0],), float(len(p))) for p in prompts]

    class FakeLoop:  # EngineLoop.run_between_steps, run by the test in place of the step thread
        def __init__(self) -> None:
            self.gaps: list[tuple[Any, asyncio.Future[Any]]] = []

        def run_between_steps(self, fn: Any) -> asyncio.Future[Any]:
            self.gaps.append((fn, asyncio.get_running_loop().create_future()))
            return self.gaps[-1][1]

    async def run() -> None:
        loop, embedder = FakeLoop(), FakeEmbedder()
        batcher = EmbeddingBatcher(loop, embedder)
        a, b, c, d = (_Job(p, 2, asyncio.get_running_loop().create_future())
                      for p in ([[1, 2], [3]], [[4, 5, 6]], [[7]], [[8]]))
        for job in (a, b, c, d):
            batcher.submit(job)
        assert len(loop.gaps) == 1  # one gap asked for, however many requests wait
        c.cancelled = True
        while loop.gaps:
            fn, future = loop.gaps.pop(0)
            future.set_result(fn())
            await asyncio.sleep(0)  # the done-callback delivers, and asks for the next gap
        assert embedder.calls == [[2, 1], [3, 1]]  # 3 tokens (b's 3 more would pass 5), then b and d
        assert [v.tolist() for v in a.future.result()] == [[2.0, 2.0], [1.0, 1.0]]
        assert b.future.result()[0].tolist() == [3.0, 3.0] and d.future.done() and not c.future.done()

    asyncio.run(run())


def test_run_between_steps_gives_results_and_errors_and_keeps_the_loop_alive() -> None:
    from service.engine.engine_loop import EngineFailure, EngineLoop

    class IdleEngine:
        def stats(self) -> None:
            return None

        def has_unfinished(self) -> bool:
            return False

    async def run() -> None:
        loop = EngineLoop(IdleEngine())
        loop.start()
        try:
            assert await asyncio.wait_for(loop.run_between_steps(lambda: 41 + 1), 10) == 42
            with pytest.raises(ZeroDivisionError):
                await asyncio.wait_for(loop.run_between_steps(lambda: 1 / 0), 10)
            assert loop.alive
        finally:
            loop.stop()
        failure = await loop.run_between_steps(lambda: 1)
        assert isinstance(failure, EngineFailure) and failure.status == 503

    asyncio.run(run())


def test_edge_errors_name_the_field(last_dir: Path) -> None:
    async def run() -> None:
        async with _edge(last_dir, body_limit=64 << 10) as (http, _):
            post = lambda body: http.post("/v1/embeddings", json=body)  # noqa: E731
            assert "empty" in _error(await post({"input": []}), 400, "input")
            assert "empty" in _error(await post({"input": ""}), 400, "input")
            assert "at most 2048" in _error(await post({"input": ["a"] * 2049}), 400, "input")
            assert "outside the vocabulary" in _error(await post({"input": [[1, 2], [5, VOCAB]]}), 400, "input")
            assert "input[1]" in _error(await post({"input": [[1, 2], [-1]]}), 400, "input")
            assert "maximum context length" in _error(await post({"input": [7] * 257}), 400, "input")
            assert "maximum context length" in _error(await post({"input": [7] * 3000}), 400, "input")
            assert "maximum context length" in _error(await post({"input": ["ab" * 300]}), 400, "input")
            assert "does not support dimensions" in _error(await post({"input": "a", "dimensions": 8}), 400,
                                                           "dimensions")
            assert "between 1 and" in _error(await post({"input": "a", "dimensions": 65}), 400, "dimensions")
            _error(await post({"input": "a", "encoding_format": "int8"}), 400, "encoding_format")
            _error(await post({"input": 3}), 400, "input")
            _error(await post({"input": "a", "truncate_prompt_tokens": 4}), 400, "truncate_prompt_tokens")
            _error(await post({"input": "a", "model": "other"}), 404, "model")
            assert (await post({"input": "x" * (70 << 10)})).status_code == 413
            ok = await post({"input": "a", "dimensions": HIDDEN})  # the full size is always allowed
            assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == HIDDEN

    asyncio.run(run())


def test_edge_api_key_and_admission(last_dir: Path) -> None:
    async def run() -> None:
        async with _edge(last_dir, capacity=0, api_key="sekret") as (http, _):
            r = await http.post("/v1/embeddings", json={"input": "a"})
            assert r.status_code == 401
            r = await http.post("/v1/embeddings", json={"input": "a"}, headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 503 and r.headers["Retry-After"] and r.json()["error"]["type"]

    asyncio.run(run())


# ---- the running service with the official client ---------------------------------------


@pytest.fixture(scope="module")
def service(last_dir: Path, shared_serve: SharedServe) -> Iterator[str]:
    args = {"model": str(last_dir), "served_model_name": "tiny-embed", "max_num_seqs": 4, "num_kv_blocks": 64,
            "engine_num_cpus": 1}
    with shared_serve(args) as url:
        yield url


def test_openai_client_float_base64_lists_token_ids(service: str, last_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{service}/v1", api_key="none", max_retries=0, timeout=120)
    ref = _reference(last_dir, TEXTS)
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == "tiny-embed"
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    torch.testing.assert_close(torch.tensor([d.embedding for d in floats.data]), ref, atol=1e-4, rtol=0)
    engine_tok = build_engine(str(last_dir), EngineConfig(num_kv_blocks=4), device="cpu").tokenizer
    ids = [engine_tok.encode(t, True) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # The client's default asks for base64 and decodes it; the raw body is little-endian float32.
    default = client.embeddings.create(model="tiny-embed", input=TEXTS[0])
    torch.testing.assert_close(torch.tensor(default.data[0].embedding), ref[0], atol=1e-4, rtol=0)
    raw = httpx.post(f"{service}/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}, timeout=60)
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    torch.testing.assert_close(torch.tensor(struct.unpack(f"<{HIDDEN}f", packed)), ref[1], atol=1e-4, rtol=0)
    by_ids = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    torch.testing.assert_close(torch.tensor([d.embedding for d in by_ids.data]), ref, atol=1e-4, rtol=0)
    one = client.embeddings.create(model="tiny-embed", input=ids[2], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[2])
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model="tiny-embed", input=[[VOCAB + 5]])
    assert bad.value.body["param"] == "input"


def test_generation_runs_while_embedding(service: str) -> None:
    client = openai.OpenAI(base_url=f"{service}/v1", api_key="none", max_retries=0, timeout=120)
    done: dict[str, Any] = {}

    def generate() -> None:
        done["completion"] = client.completions.create(model="tiny-embed", prompt="The cat", max_tokens=160,
                                                       temperature=0, extra_body={"ignore_eos": True})

    thread = threading.Thread(target=generate)
    thread.start()
    for _ in range(6):
        out = client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
        assert len(out.data) == len(TEXTS)
    thread.join(120)
    completion = done["completion"]
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 160
