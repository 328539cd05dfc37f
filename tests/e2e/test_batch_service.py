"""The Files and Batch APIs on real Ray Serve behind HAProxy, two engine replicas sharing one
`batch_dir`, with the official `openai` client: a file uploaded through either replica is found
through the other, a batch runs once (every request answered exactly once, as the interactive
endpoint answers it), whichever replica a poll reaches reports the same batch, Ray's metrics
endpoint counts the batch and its lines, a batch whose replicas are killed mid-run resumes on
their replacements with no line lost and none answered twice, and a batch of
`batch_offline_min_lines` runs as a Ray Data job while the replicas' engines compute nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import ray

from tests.support.local_serve import local_service
from tests.support.polling import wait_until
from tests.support.serve_fixtures import scrape, write_tiny_model

pytestmark = pytest.mark.slow

MODEL = "tiny-batch"
HTTP_PORT, METRICS_PORT = 18580, 18581
METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
ENGINE_REPLICA = "SERVE_REPLICA::qkv#EngineDeployment#"
ENDED = ("completed", "failed", "cancelled", "expired")
OFFLINE_MIN_LINES = 64  # a batch this large runs as a Ray Data job (the module's other batches are smaller)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    batch_dir = tmp_path_factory.mktemp("batch")
    gate = tmp_path_factory.mktemp("gate") / "hold"  # while it exists, the engines compute nothing
    args = {"model": str(model), "served_model_name": MODEL, "num_replicas": 2, "engine_num_cpus": 0.5,
            "max_num_seqs": 4, "num_kv_blocks": 128, "batch_dir": str(batch_dir),
            "batch_offline_min_lines": OFFLINE_MIN_LINES, "batch_offline_num_cpus": 0.25}
    with local_service(args, HTTP_PORT, metrics_port=METRICS_PORT, step_gate=str(gate)) as url:
        yield url, batch_dir, gate


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _submit(client: openai.OpenAI, prompts: dict[str, list[int]], max_tokens: int) -> str:
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions",
                         "body": {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}})
             for k, p in prompts.items()]
    upload = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    for _ in range(4):  # HAProxy spreads these over both replicas: each finds the file on the shared disk
        assert client.files.retrieve(upload.id).bytes == upload.bytes
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id


def _ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 180):
    def probe():
        try:
            now = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError):  # replicas being replaced behind HAProxy
            return None
        return now if now.status in ENDED else None
    return wait_until(probe, timeout_s, f"batch {batch_id} to end")


def _output(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(x) for x in client.files.content(file_id).read().splitlines()]


def _metric(name: str, **labels: str) -> list[float]:
    return [v for n, lab, v in scrape(METRICS_URL) if n == name and all(lab.get(k) == x for k, x in labels.items())]


def test_a_batch_runs_once_across_two_replicas_and_either_answers_for_it(service: tuple[str, Path, Path]) -> None:
    url, batch_dir, _ = service
    client = _client(url)
    # What the module's other tests left (they may run first): this test counts from there.
    listed = list(client.batches.list())
    earlier = [b.id for b in listed]
    completed_earlier = sum(b.status == "completed" for b in listed)
    lines_earlier = _live_lines()  # settled: the test that ran lines before waits for its count
    prompts = {f"r{i}": [5 + i, 6, 7, 8] for i in range(8)}
    batch_id = _submit(client, prompts, max_tokens=4)
    done = _ended(client, batch_id)
    assert done.status == "completed" and done.request_counts.completed == 8 and done.request_counts.failed == 0
    output = _output(client, done.output_file_id)
    assert [x["custom_id"] for x in output] == list(prompts)  # each once, in the input's order
    for x in output:
        direct = client.completions.create(model=MODEL, prompt=prompts[x["custom_id"]], max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    for _ in range(4):
        assert client.batches.retrieve(batch_id).status == "completed"
    assert [b.id for b in client.batches.list()] == [batch_id, *earlier]  # newest first
    assert not list((batch_dir / "batches").glob("*.answers.jsonl"))  # the journal went into the files
    # Ray's metrics endpoint: the lines, counted by the replica that ran them, and the batch by
    # status, as both replicas see the shared directory.
    wait_until(lambda: sum(n - lines_earlier.get(r, 0.0) for r, n in _live_lines().items()) == 8, 60,
               "8 more completed batch lines on Ray's metrics endpoint")
    wait_until(lambda: max(_metric("ray_qkv_batches", status="completed"), default=0) == completed_earlier + 1, 60,
               "one more completed batch on Ray's metrics endpoint")
    assert max(_metric("ray_qkv_batches", status="in_progress"), default=0) == 0


def _live_lines() -> dict[str, float]:
    """Completed batch lines on Ray's metrics endpoint by live engine replica (a killed replica's
    count may linger there or vanish: not counted)."""
    live = {name.removeprefix(ENGINE_REPLICA) for name in _engine_replicas()}
    lines: dict[str, float] = {}
    for n, lab, v in scrape(METRICS_URL):
        if (n == "ray_qkv_batch_lines_total" and lab.get("outcome") == "completed" and lab.get("model_name") == MODEL
                and lab.get("replica") in live):
            lines[lab["replica"]] = lines.get(lab["replica"], 0.0) + v
    return lines


def _answered(batch_dir: Path, batch_id: str) -> dict[str, str]:
    """custom_id -> the id of its answer line, from the batch's journal on the shared disk."""
    journal = batch_dir / "batches" / f"{batch_id}.answers.jsonl"
    if not journal.exists():
        return {}
    lines = [json.loads(x) for x in journal.read_text().splitlines() if x.endswith("}")]
    return {x["custom_id"]: x["id"] for x in lines}


def _engine_replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(ENGINE_REPLICA)}


def test_a_batch_whose_replicas_are_killed_resumes_with_no_line_lost_or_answered_twice(
        service: tuple[str, Path, Path]) -> None:
    url, batch_dir, gate = service
    client = _client(url)
    prompts = {f"k{i}": [9 + i % 40, 6 + i % 7, 7, 8] for i in range(48)}
    batch_id = _submit(client, prompts, max_tokens=32)
    # Part of the batch answered, then the engines held, so that what the journal holds when the
    # replicas die is known: the kill lands mid-batch, not before it nor after.
    wait_until(lambda: len(_answered(batch_dir, batch_id)) >= 3, 120, "the batch's first answers", every_s=0.02)
    gate.touch()
    victims = _engine_replicas()
    assert len(victims) == 2
    for name in victims:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_until(lambda: len(_engine_replicas() - victims) == 2 and not _engine_replicas() & victims, 120,
               "Serve to replace both engine replicas")
    before = _answered(batch_dir, batch_id)  # the new replicas are held: nothing more is answered yet
    assert 3 <= len(before) < len(prompts), len(before)
    gate.unlink()
    done = _ended(client, batch_id, timeout_s=240)
    assert done.status == "completed", done
    assert done.request_counts.completed == len(prompts) and done.request_counts.failed == 0
    output = _output(client, done.output_file_id)
    assert [x["custom_id"] for x in output] == list(prompts)  # none lost, none twice, in the input's order
    # An answer recorded before the kill is the one in the output: its request was not run again.
    assert {x["custom_id"]: x["id"] for x in output if x["custom_id"] in before} == before
    for x in output[:: len(output) // 6]:  # the resumed lines answer as the interactive endpoint does
        direct = client.completions.create(model=MODEL, prompt=prompts[x["custom_id"]], max_tokens=32,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
    # The replacements ran every line not answered before the kill, each once; wait for their count
    # on Ray's endpoint, so that a test after this one starts from settled counters.
    wait_until(lambda: sum(_live_lines().values()) == len(prompts) - len(before), 60,
               "the resumed lines on Ray's metrics endpoint")


def test_a_large_batch_runs_as_a_ray_data_job_while_the_replicas_engines_compute_nothing(
        service: tuple[str, Path, Path]) -> None:
    url, _, gate = service
    client = _client(url)
    lines_earlier = sum(_live_lines().values())
    prompts = {f"o{i}": [10 + i % 50, 6, 7 + i % 3, 8] for i in range(OFFLINE_MIN_LINES)}
    gate.touch()  # the replicas' engines hold every step: only the job's own engine can answer
    try:
        batch_id = _submit(client, prompts, max_tokens=4)
        done = _ended(client, batch_id, timeout_s=240)
    finally:
        gate.unlink()
    assert done.status == "completed", done
    assert done.request_counts.completed == len(prompts) and done.request_counts.failed == 0
    output = _output(client, done.output_file_id)
    assert [x["custom_id"] for x in output] == list(prompts)
    for x in output[:: len(output) // 8]:  # the job's answers are the interactive endpoint's
        direct = client.completions.create(model=MODEL, prompt=prompts[x["custom_id"]], max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        assert x["response"]["body"]["usage"] == direct.usage.model_dump(exclude_none=True)
    # The replica that held the batch counts its lines (so a test after this one starts from settled counters).
    wait_until(lambda: sum(_live_lines().values()) - lines_earlier == len(prompts), 60,
               "the job's lines on Ray's metrics endpoint")
