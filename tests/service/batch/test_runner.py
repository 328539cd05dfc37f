"""Running batches (service/batch/runner.py) from validation to their end, through a `send` that
answers as an endpoint does (200 with a body, or 400 with the error shape for a body it refuses):
the output and error files, cancellation, expiry, owners, and a restart mid-batch that neither
loses an answer nor sends a request twice; each on a directory and on an object store (the
`root` fixture of conftest.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from service.batch.api import BatchLoop
from service.batch.batches import STATUSES, BatchJournal, answer_line
from service.batch.files import FileStore
from service.batch.runner import BatchRunner
from service.batch.storage import open_storage
from service.errors import APIError
from tests.support.polling import wait_until_async

CHAT = "/v1/chat/completions"


def request_line(custom_id: str, max_tokens: int = 4) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": {"model": "m", "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": custom_id}]}})


class Endpoint:
    """Answers a chat body: 400 in the error shape for max_tokens < 1, else 200 echoing the prompt.
    Counts what it was sent; `gate` (when set) holds every request until it is opened."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.gate: asyncio.Event | None = None
        self.fail_after: int | None = None  # raise (the process stopping) once this many were answered
        self.arrived = 0  # requests that reached the endpoint (answered or waiting at the gate)

    async def __call__(self, url: str, body: dict, owner: str | None) -> tuple[int, dict]:
        assert url == CHAT
        if self.fail_after is not None and sum(self.sent.values()) >= self.fail_after:
            raise RuntimeError("the engine went away")
        self.arrived += 1
        if self.gate is not None:
            await self.gate.wait()
        prompt = body["messages"][0]["content"]
        self.sent[prompt] += 1
        if body["max_tokens"] < 1:
            return 400, {"error": {"message": "max_tokens must be at least 1", "type": "invalid_request_error",
                                   "param": "max_tokens", "code": None}}
        return 200, {"object": "chat.completion", "choices": [{"message": {"content": f"re: {prompt}"}}]}


def upload(files: FileStore, *lines: str, owner: str | None = None) -> str:
    return files.create(("\n".join(lines) + "\n").encode(), "in.jsonl", "batch", owner).id


def lines_of(files: FileStore, file_id: str | None, owner: str | None = None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in files.content(file_id, owner).splitlines()]


def test_a_batch_runs_to_completed_with_its_output_and_error_files(root) -> None:
    files, endpoint, outcomes = FileStore(root), Endpoint(), Counter()
    runner = BatchRunner(root, files, endpoint, on_line=lambda o: outcomes.update([o]))
    file_id = upload(files, request_line("a"), request_line("bad", max_tokens=0), request_line("c"))
    batch = runner.create(file_id, CHAT, "24h", {"job": "t"}, None)
    assert runner.pending() == [batch.id]
    done = asyncio.run(runner.run(batch.id)).to_openai()
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert all(done[f"{s}_at"] for s in ("in_progress", "finalizing", "completed"))
    output = lines_of(files, done["output_file_id"])
    assert [x["custom_id"] for x in output] == ["a", "c"]
    assert output[0]["response"]["status_code"] == 200 and output[0]["error"] is None
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == "re: a"
    [error] = lines_of(files, done["error_file_id"])
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "max_tokens"
    assert files.get(done["output_file_id"], None).purpose == "batch_output"
    assert runner.pending() == [] and endpoint.sent == Counter({"a": 1, "bad": 1, "c": 1})
    assert outcomes == Counter({"completed": 2, "failed": 1})  # what qkv_batch_lines_total counts


def test_a_file_with_a_wrong_structure_fails_the_batch_and_sends_nothing(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    runner = BatchRunner(root, files, endpoint)
    file_id = upload(files, request_line("a"), "not json", request_line("a"))
    batch = asyncio.run(runner.run(runner.create(file_id, CHAT, "24h", None, None).id)).to_openai()
    assert batch["status"] == "failed" and batch["failed_at"] and batch["output_file_id"] is None
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(2, "invalid_json_line"),
                                                                        (3, "duplicate_custom_id")]
    assert not endpoint.sent


def test_a_restart_mid_batch_sends_only_what_was_not_answered(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    ids = [f"r{i}" for i in range(7)]
    file_id = upload(files, *(request_line(i) for i in ids))
    first = BatchRunner(root, files, endpoint, concurrency=1)
    batch_id = first.create(file_id, CHAT, "24h", None, None).id
    endpoint.fail_after = 3
    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(first.run(batch_id))
    # The process stops here; a new one opens the same directory.
    endpoint.fail_after = None
    second = BatchRunner(root, FileStore(root), endpoint)
    record = second.get(batch_id, None)
    assert record.status == "in_progress" and (record.completed, record.total) == (3, 7)
    assert second.pending() == [batch_id]
    done = asyncio.run(second.run(batch_id))
    assert done.status == "completed" and done.completed == 7
    assert [x["custom_id"] for x in lines_of(second.files, done.output_file_id)] == ids
    assert endpoint.sent == Counter({i: 1 for i in ids})  # none sent twice, none lost
    third = BatchRunner(root, FileStore(root), endpoint)  # an ended batch keeps its counts
    assert third.get(batch_id, None).to_openai()["request_counts"] == {"total": 7, "completed": 7, "failed": 0}


def test_cancelling_ends_the_batch_with_the_answers_so_far(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    runner = BatchRunner(root, files, endpoint, concurrency=2)
    batch_id = runner.create(upload(files, *(request_line(f"r{i}") for i in range(6))), CHAT, "24h", None, None).id

    async def scenario():
        endpoint.gate = asyncio.Event()
        task = asyncio.create_task(runner.run(batch_id))
        while endpoint.arrived < 2:  # the two requests concurrency lets in now wait at the gate
            await asyncio.sleep(0)
        assert runner.cancel(batch_id, None).status == "cancelling"
        assert open_storage(root).lock(f"batches/{batch_id}.lock") is None  # the run still holds the batch
        endpoint.gate.set()
        return await task

    done = asyncio.run(scenario()).to_openai()
    assert done["status"] == "cancelled" and done["cancelling_at"] and done["cancelled_at"]
    assert done["request_counts"]["completed"] == 2 and sum(endpoint.sent.values()) == 2
    assert len(lines_of(files, done["output_file_id"])) == 2
    with pytest.raises(APIError) as err:
        runner.cancel(batch_id, None)
    assert err.value.status == 409


def test_an_expired_batch_gives_each_request_not_run_an_expired_error(root) -> None:
    files, endpoint, outcomes = FileStore(root), Endpoint(), Counter()
    now = [1_000_000.0]
    runner = BatchRunner(root, files, endpoint, clock=lambda: now[0], on_line=lambda o: outcomes.update([o]))
    batch = runner.create(upload(files, request_line("a"), request_line("b")), CHAT, "24h", None, None)
    now[0] = batch.expires_at + 1.0
    done = asyncio.run(runner.run(batch.id)).to_openai()
    assert done["status"] == "expired" and done["output_file_id"] is None and not endpoint.sent
    errors = lines_of(files, done["error_file_id"])
    assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in errors] == [("a", "batch_expired", None),
                                                                                   ("b", "batch_expired", None)]
    assert outcomes == Counter({"expired": 2})


def test_a_tenant_sees_and_cancels_only_its_own_batches(root) -> None:
    files = FileStore(root)
    runner = BatchRunner(root, files, Endpoint())
    theirs = upload(files, request_line("a"), owner="tenant-a")
    with pytest.raises(APIError) as err:
        runner.create(theirs, CHAT, "24h", None, "tenant-b")
    assert err.value.status == 404
    batch = runner.create(theirs, CHAT, "24h", None, "tenant-a")
    for call in (lambda: runner.get(batch.id, "tenant-b"), lambda: runner.cancel(batch.id, "tenant-b")):
        with pytest.raises(APIError) as err:
            call()
        assert err.value.status == 404
    assert runner.list("tenant-b")["data"] == [] and [b["id"] for b in runner.list("tenant-a")["data"]] == [batch.id]
    output = files.write(b"{}\n", "out.jsonl", "batch_output", "tenant-a")
    with pytest.raises(APIError) as err:
        runner.create(output.id, CHAT, "24h", None, "tenant-a")
    assert err.value.param == "input_file_id"


def test_listing_batches_pages_newest_first(root) -> None:
    files = FileStore(root)
    runner = BatchRunner(root, files, Endpoint())
    file_id = upload(files, request_line("a"))
    made = [runner.create(file_id, CHAT, "24h", None, None).id for _ in range(5)]
    everything = [b["id"] for b in runner.list(None, limit=100)["data"]]
    assert sorted(everything) == sorted(made)
    page = runner.list(None, limit=2)
    assert page["has_more"] and [b["id"] for b in page["data"]] == everything[:2]
    assert [b["id"] for b in runner.list(None, after=page["last_id"])["data"]] == everything[2:]


def test_replicas_sharing_the_directory_see_one_batch_run_once_and_cancel_it_from_either(root) -> None:
    """Two runners over one directory, as the replicas of a node: a batch created by one is seen
    by the other, runs in only one of them (the other's run returns None while it holds the lock),
    and a cancel that reaches the other stops it."""
    endpoint = Endpoint()
    one = BatchRunner(root, FileStore(root), endpoint, concurrency=1)
    other = BatchRunner(root, FileStore(root), endpoint, concurrency=1)
    batch_id = one.create(upload(one.files, *(request_line(f"r{i}") for i in range(5))), CHAT, "24h", None, None).id
    assert other.pending() == [batch_id] and other.get(batch_id, None).status == "validating"

    async def scenario():
        endpoint.gate = asyncio.Event()
        running = asyncio.create_task(one.run(batch_id))
        while endpoint.arrived < 1:  # `one` holds the batch, its first request waits at the gate
            await asyncio.sleep(0)
        assert await other.run(batch_id) is None  # held by `one`: not run twice
        assert other.cancel(batch_id, None).status == "cancelling"
        endpoint.gate.set()
        return await running

    done = asyncio.run(scenario())
    assert done.status == "cancelled" and done.completed == 1 and sum(endpoint.sent.values()) == 1
    assert other.get(batch_id, None).to_openai()["request_counts"]["completed"] == 1
    assert other.pending() == [] and not open_storage(root).exists(f"batches/{batch_id}.cancel")


def test_a_batch_cancelled_before_it_runs_ends_without_sending_anything(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    runner = BatchRunner(root, files, endpoint)
    batch_id = runner.create(upload(files, request_line("a")), CHAT, "24h", None, None).id
    assert runner.cancel(batch_id, None).status == "cancelling"
    assert runner.get(batch_id, None).status == "cancelling"  # written at once: nobody was running it
    done = asyncio.run(runner.run(batch_id))
    assert done.status == "cancelled" and not endpoint.sent and done.output_file_id is None


def test_the_batches_are_counted_by_status_every_status_named(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    runner = BatchRunner(root, files, endpoint)
    first = runner.create(upload(files, request_line("a")), CHAT, "24h", None, None)
    runner.create(upload(files, request_line("b"), owner="tenant-b"), CHAT, "24h", None, "tenant-b")  # every owner's
    asyncio.run(runner.run(first.id))
    counts = BatchJournal.status_counts(root)
    assert set(counts) == set(STATUSES)  # a status no batch has is 0, so its gauge falls back
    assert counts["completed"] == 1 and counts["validating"] == 1 and sum(counts.values()) == 2


def test_the_loop_reports_the_statuses_while_it_runs_a_batch(root) -> None:
    files, endpoint = FileStore(root), Endpoint()
    endpoint.gate = asyncio.Event()  # the batch's requests wait: the loop is busy running it
    runner = BatchRunner(root, files, endpoint)
    runner.create(upload(files, request_line("a"), request_line("b")), CHAT, "24h", None, None)
    reports: list[dict[str, int]] = []

    async def scenario() -> None:
        loop = BatchLoop(runner, on_statuses=reports.append, status_every_s=0.02)
        loop.ensure()
        await wait_until_async(lambda: endpoint.arrived >= 1 and any(r["in_progress"] == 1 for r in reports), 30,
                               "an in_progress report while the batch's requests wait")
        endpoint.gate.set()
        await wait_until_async(lambda: any(r["completed"] == 1 for r in reports), 30, "a completed report")

    asyncio.run(scenario())
    assert all(sum(r.values()) == 1 for r in reports)


class FakeOffline:
    """An `Offline` that answers as `Endpoint` does (each answer in order, a tick between them) and
    records what it was given; `held` (when set) holds the answers after the first `hold_after`."""

    def __init__(self, endpoint: Endpoint, min_lines: int, takes: bool = True) -> None:
        self.endpoint, self.min_lines, self._takes = endpoint, min_lines, takes
        self.given: list[list[str]] = []
        self.closed = 0
        self.hold_after: int | None = None
        self.fail_after: int | None = None

    def takes(self, owner: str | None) -> bool:
        return self._takes

    async def answers(self, endpoint: str, requests: list, owner: str | None):
        self.given.append([custom_id for custom_id, _ in requests])
        try:
            for i, (custom_id, body) in enumerate(requests):
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("the batch's Ray Data job failed: an actor died")
                while self.hold_after is not None and i >= self.hold_after:
                    yield None  # nothing comes: the runner hears a tick
                    await asyncio.sleep(0.01)
                status, answer = await self.endpoint(endpoint, body, owner)
                yield custom_id, status, answer
                yield None
        finally:
            self.closed += 1


def test_a_batch_of_min_lines_runs_offline_and_a_smaller_one_through_send(root) -> None:
    files, offline_side, send = FileStore(root), Endpoint(), Endpoint()
    offline = FakeOffline(offline_side, min_lines=3)
    runner = BatchRunner(root, files, send, offline=offline)
    big = runner.create(upload(files, request_line("a"), request_line("bad", max_tokens=0), request_line("c")),
                        CHAT, "24h", None, None)
    small = runner.create(upload(files, request_line("x"), request_line("y")), CHAT, "24h", None, None)
    done = asyncio.run(runner.run(big.id)).to_openai()
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert offline.given == [["a", "bad", "c"]] and offline.closed == 1 and not send.sent
    assert [x["response"]["body"]["choices"][0]["message"]["content"]
            for x in lines_of(files, done["output_file_id"])] == ["re: a", "re: c"]
    assert lines_of(files, done["error_file_id"])[0]["response"]["body"]["error"]["param"] == "max_tokens"
    assert asyncio.run(runner.run(small.id)).status == "completed"
    assert send.sent == Counter({"x": 1, "y": 1}) and len(offline.given) == 1


def test_a_batch_the_offline_side_does_not_take_runs_through_send(root) -> None:
    files, send = FileStore(root), Endpoint()
    offline = FakeOffline(Endpoint(), min_lines=1, takes=False)
    runner = BatchRunner(root, files, send, offline=offline)
    batch = runner.create(upload(files, request_line("a"), request_line("b"), owner="tenant-a"), CHAT, "24h", None,
                          "tenant-a")
    assert asyncio.run(runner.run(batch.id)).status == "completed"
    assert send.sent == Counter({"a": 1, "b": 1}) and offline.given == []


def test_an_offline_run_that_fails_resumes_with_only_what_was_not_answered(root) -> None:
    files, side = FileStore(root), Endpoint()
    ids = [f"r{i}" for i in range(6)]
    offline = FakeOffline(side, min_lines=5)
    offline.fail_after = 2
    batch_id = BatchRunner(root, files, Endpoint(), offline=offline).create(
        upload(files, *(request_line(i) for i in ids)), CHAT, "24h", None, None).id
    with pytest.raises(RuntimeError, match="actor died"):
        asyncio.run(BatchRunner(root, files, Endpoint(), offline=offline).run(batch_id))
    offline.fail_after = None
    runner = BatchRunner(root, FileStore(root), Endpoint(), offline=offline)
    assert runner.get(batch_id, None).completed == 2
    done = asyncio.run(runner.run(batch_id))
    # Still offline after the restart (the whole batch's size decides), and only the rest was given.
    assert offline.given == [ids, ids[2:]] and done.status == "completed" and done.completed == 6
    assert side.sent == Counter({i: 1 for i in ids})
    assert [x["custom_id"] for x in lines_of(files, done.output_file_id)] == ids


def test_a_batch_answered_whole_before_a_restart_ends_without_starting_a_job(root) -> None:
    files, side = FileStore(root), Endpoint()
    offline = FakeOffline(side, min_lines=2)
    runner = BatchRunner(root, files, Endpoint(), offline=offline)
    batch_id = runner.create(upload(files, request_line("a"), request_line("b")), CHAT, "24h", None, None).id
    record = runner.get(batch_id, None)
    record.total = 2
    record.enter("in_progress", 1.0)
    journal = BatchJournal(open_storage(root), record)
    journal.save()
    for custom_id in ("a", "b"):  # answered, then the process stopped before the batch's end
        journal.append(answer_line(batch_id, custom_id, 200, {"choices": []}))
    done = asyncio.run(BatchRunner(root, FileStore(root), Endpoint(), offline=offline).run(batch_id))
    assert done.status == "completed" and done.completed == 2 and offline.given == []


def test_a_batch_whose_offline_run_failed_goes_on_through_send_in_that_process(root) -> None:
    files, side, send = FileStore(root), Endpoint(), Endpoint()
    ids = [f"r{i}" for i in range(5)]
    offline = FakeOffline(side, min_lines=5)
    offline.fail_after = 2
    runner = BatchRunner(root, files, send, offline=offline)
    batch_id = runner.create(upload(files, *(request_line(i) for i in ids)), CHAT, "24h", None, None).id
    with pytest.raises(RuntimeError, match="actor died"):
        asyncio.run(runner.run(batch_id))
    done = asyncio.run(runner.run(batch_id))  # the loop's next pass
    assert done.status == "completed" and done.completed == 5 and len(offline.given) == 1
    assert side.sent == Counter(ids[:2]) and send.sent == Counter(ids[2:])  # each once, none lost


def test_cancelling_an_offline_run_closes_it_with_the_answers_so_far(root, monkeypatch) -> None:
    from service.batch import runner as runner_module

    monkeypatch.setattr(runner_module, "SAVE_EVERY_S", 0.0)  # look for the cancel at every tick
    files, side = FileStore(root), Endpoint()
    offline = FakeOffline(side, min_lines=1)
    offline.hold_after = 2
    runner = BatchRunner(root, files, Endpoint(), offline=offline)
    batch_id = runner.create(upload(files, *(request_line(f"r{i}") for i in range(5))), CHAT, "24h", None, None).id

    async def scenario():
        task = asyncio.create_task(runner.run(batch_id))
        while sum(side.sent.values()) < 2:
            await asyncio.sleep(0.01)
        other = BatchRunner(root, FileStore(root), Endpoint())  # the cancel reaches another replica
        assert other.cancel(batch_id, None).status == "cancelling"
        return await asyncio.wait_for(task, 30)

    done = asyncio.run(scenario()).to_openai()
    assert done["status"] == "cancelled" and done["request_counts"]["completed"] == 2 and offline.closed == 1
    assert [x["custom_id"] for x in lines_of(files, done["output_file_id"])] == ["r0", "r1"]
