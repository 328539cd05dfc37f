"""The Files and Batch APIs on a replica's real HTTP edge over a real engine (service/batch/api.py),
driven with the official `openai` client: a batch's lines get what the interactive endpoint
answers, a file with a wrong structure fails its batch with the lines named, uploads over the
limits get 413, and a tenant sees only its own files and batches."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from service.server.api import IngressSettings
from tests.support.in_process import edge_app
from tests.support.tiny_models import write_tiny_llama

MODEL = "tiny"
DONE = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from model.config import EngineConfig
    from model.engine.builder import build_engine

    directory = write_tiny_llama(tmp_path_factory.mktemp("batch") / "tiny", vocab_size=300)
    return build_engine(str(directory), EngineConfig(num_kv_blocks=64, max_num_seqs=4), device="cpu", dtype="float32")


def line(custom_id: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "temperature": 0, **body}})


async def finished(client: openai.AsyncOpenAI, batch_id: str) -> Any:
    """The batch once it has ended (polled: the replica's loop runs it beside the test)."""
    for _ in range(2000):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in DONE:
            return batch
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


def run(engine: Any, settings: IngressSettings, scenario) -> None:
    async def main() -> None:
        async with edge_app(engine, MODEL, settings) as app, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://edge", timeout=60) as http:
            def client(key: str = "unused") -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url="http://edge/v1", api_key=key, http_client=http, max_retries=0)
            await scenario(client)
    asyncio.run(main())


@pytest.mark.parametrize("where", ["directory", "fsspec"])
def test_a_batch_gets_what_the_endpoint_answers_line_by_line(engine: Any, tmp_path: Path, where: str) -> None:
    """`fsspec`: batch_dir a `local://` URI, fsspec's own local filesystem, run as an object store
    (service/batch/storage.py: an object per journal line, a lease), the path an s3:// store takes."""
    async def scenario(client) -> None:
        oai = client()
        prompts = {"a": [5, 6, 7], "b": [9, 10, 11, 12], "c": [20, 21]}
        content = "\n".join([line(k, prompt=p, max_tokens=5) for k, p in prompts.items()]
                            + [line("bad", prompt=[1, 2], max_tokens=-1)]) + "\n"
        upload = await oai.files.create(file=("in.jsonl", content.encode()), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(content.encode())
        assert [f.id async for f in oai.files.list()] == [upload.id]
        batch = await oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                         completion_window="24h", metadata={"job": "test"})
        assert batch.status in ("validating", "in_progress", "completed") and batch.metadata == {"job": "test"}
        batch = await finished(oai, batch.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
        output = [json.loads(x) for x in (await oai.files.content(batch.output_file_id)).read().splitlines()]
        assert [x["custom_id"] for x in output] == ["a", "b", "c"]
        for x in output:  # the interactive endpoint's answer for the same request
            direct = await oai.completions.create(model=MODEL, prompt=prompts[x["custom_id"]], max_tokens=5,
                                                  temperature=0)
            assert x["response"]["status_code"] == 200
            assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        [error] = [json.loads(x) for x in (await oai.files.content(batch.error_file_id)).read().splitlines()]
        with pytest.raises(openai.BadRequestError) as direct_error:
            await oai.completions.create(model=MODEL, prompt=[1, 2], max_tokens=-1)
        assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
        assert error["response"]["body"]["error"]["param"] == direct_error.value.body["param"] == "max_tokens"
        assert [b.id async for b in oai.batches.list()] == [batch.id]

    batch_dir = str(tmp_path) if where == "directory" else f"local://{tmp_path}"
    run(engine, IngressSettings(batch_dir=batch_dir), scenario)
    if where == "fsspec":  # the journal's objects are gone with the batch, and its lease with its run
        assert not list((tmp_path / "batches").glob("*.answers.jsonl*"))
        assert not list((tmp_path / "batches").glob("*.lock"))


def test_a_file_with_a_wrong_structure_fails_its_batch_with_the_lines_named(engine: Any, tmp_path: Path) -> None:
    async def scenario(client) -> None:
        oai = client()
        content = line("a", prompt=[5], max_tokens=2) + "\n{not json\n" + line("a", prompt=[6], max_tokens=2) + "\n"
        upload = await oai.files.create(file=("in.jsonl", content.encode()), purpose="batch")
        batch = await finished(oai, (await oai.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                               completion_window="24h")).id)
        assert batch.status == "failed" and batch.output_file_id is None
        assert [(e.line, e.code) for e in batch.errors.data] == [(2, "invalid_json_line"), (3, "duplicate_custom_id")]
        with pytest.raises(openai.BadRequestError) as err:
            await oai.batches.create(input_file_id=upload.id, endpoint="/v1/images", completion_window="24h")
        assert err.value.body["param"] == "endpoint"
        with pytest.raises(openai.NotFoundError):
            await oai.batches.create(input_file_id="file-none", endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.ConflictError):
            await oai.batches.cancel(batch.id)

    run(engine, IngressSettings(batch_dir=str(tmp_path)), scenario)


def test_uploads_over_the_limits_get_413(engine: Any, tmp_path: Path) -> None:
    async def scenario(client) -> None:
        oai = client()
        with pytest.raises(openai.APIStatusError) as err:
            await oai.files.create(file=("big.jsonl", b"x" * 2000), purpose="batch")
        assert err.value.status_code == 413 and err.value.body["code"] == "file_too_large"
        with pytest.raises(openai.APIStatusError) as err:
            await oai.files.create(file=("many.jsonl", b"{}\n" * 4), purpose="batch")
        assert err.value.status_code == 413 and err.value.body["code"] == "too_many_lines"
        assert [f async for f in oai.files.list()] == []

    run(engine, IngressSettings(batch_dir=str(tmp_path), batch_max_file_bytes=1000, batch_max_lines=3), scenario)


def test_a_tenant_sees_only_its_own_files_and_batches_and_its_batch_runs_as_it(engine: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    from service.tenancy.keys import hash_key

    keys.write_text("tenants:\n" + "".join(f"  {t}:\n    keys: [\"{hash_key('key-' + t)}\"]\n" for t in ("a", "b")))

    async def scenario(client) -> None:
        a, b = client("key-a"), client("key-b")
        upload = await a.files.create(file=("in.jsonl", (line("x", prompt=[5, 6], max_tokens=2) + "\n").encode()),
                                      purpose="batch")
        batch = await a.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        for call in (b.files.retrieve(upload.id), b.files.content(upload.id), b.batches.retrieve(batch.id),
                     b.batches.cancel(batch.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        assert [f async for f in b.files.list()] == [] and [x async for x in b.batches.list()] == []
        with pytest.raises(openai.AuthenticationError):
            await client("wrong").files.list()
        done = await finished(a, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1
        output = (await a.files.content(done.output_file_id)).read()
        assert json.loads(output)["response"]["status_code"] == 200

    run(engine, IngressSettings(batch_dir=str(tmp_path / "batches"), api_keys_file=str(keys)), scenario)
