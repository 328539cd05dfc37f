"""The Files and Batch APIs on real Ray Serve behind HAProxy, two engine replicas sharing one
`batch_dir`, with the official `openai` client: a file uploaded through either replica is found
through the other, a batch runs once (every request answered exactly once, as the interactive
endpoint answers it), and whichever replica a poll reaches reports the same batch."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.local_serve import SharedServe
from tests.support.polling import wait_until
from tests.support.serve_fixtures import write_tiny_model

pytestmark = pytest.mark.slow

MODEL = "tiny-batch"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, shared_serve: SharedServe) -> Iterator[tuple[str, Path]]:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    batch_dir = tmp_path_factory.mktemp("batch")
    args = {"model": str(model), "served_model_name": MODEL, "num_replicas": 2, "engine_num_cpus": 0.5,
            "max_num_seqs": 4, "num_kv_blocks": 128, "batch_dir": str(batch_dir)}
    with shared_serve(args) as url:
        yield url, batch_dir


def test_a_batch_runs_once_across_two_replicas_and_either_answers_for_it(service: tuple[str, Path]) -> None:
    url, batch_dir = service
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = {f"r{i}": [5 + i, 6, 7, 8] for i in range(8)}
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0}})
             for k, p in prompts.items()]
    upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    for _ in range(4):  # HAProxy spreads these over both replicas: each finds the file on the shared disk
        assert client.files.retrieve(upload.id).bytes == upload.bytes
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")

    def ended():
        now = client.batches.retrieve(batch.id)
        return now if now.status in ("completed", "failed", "cancelled", "expired") else None

    done = wait_until(ended, 180, "the batch to end")
    assert done.status == "completed" and done.request_counts.completed == 8 and done.request_counts.failed == 0
    output = [json.loads(x) for x in client.files.content(done.output_file_id).read().splitlines()]
    assert [x["custom_id"] for x in output] == list(prompts)  # each once, in the input's order
    for x in output:
        direct = client.completions.create(model=MODEL, prompt=prompts[x["custom_id"]], max_tokens=4, temperature=0)
        assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    for _ in range(4):
        assert client.batches.retrieve(batch.id).status == "completed"
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert not list((batch_dir / "batches").glob("*.answers.jsonl"))  # the journal went into the files
