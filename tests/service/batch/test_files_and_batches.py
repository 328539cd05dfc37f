"""Files and batches in their store (service/batch/): uploads with their limits and owners, an
input file's checks line by line, the batch object's arguments, and the journal that a restart
reads back without losing or repeating an answer; on a directory and on an object store (the
`root` fixture of conftest.py), and the lease that keeps a batch in one process of an object store."""

from __future__ import annotations

import json
import os
import time

import pytest

from service.batch.batches import BatchJournal, answer_line, check_input, new_batch
from service.batch.files import FileStore
from service.batch.storage import FsspecStorage, open_storage
from service.errors import APIError

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str = CHAT, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}, **extra})


def jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# ---- files ----------------------------------------------------------------------------------

def test_an_upload_is_kept_listed_read_and_deleted(root) -> None:
    store = FileStore(root)
    content = jsonl(line("a"), line("b"))
    record = store.create(content, "in.jsonl", "batch", owner=None)
    obj = record.to_openai()
    assert obj["object"] == "file" and obj["bytes"] == len(content) and obj["purpose"] == "batch"
    assert obj["status"] == "processed" and record.lines == 2
    assert store.content(record.id, None) == content
    assert store.list(None)["data"] == [obj]
    assert store.delete(record.id, None) == {"id": record.id, "object": "file", "deleted": True}
    with pytest.raises(APIError) as err:
        store.get(record.id, None)
    assert err.value.status == 404
    assert open_storage(root).names("files") == []


def test_a_file_is_seen_only_by_its_owner(root) -> None:
    store = FileStore(root)
    mine = store.create(jsonl(line("a")), "a.jsonl", "batch", owner="tenant-a")
    for call in (lambda: store.get(mine.id, "tenant-b"), lambda: store.content(mine.id, "tenant-b"),
                 lambda: store.delete(mine.id, "tenant-b"), lambda: store.get(mine.id, None)):
        with pytest.raises(APIError) as err:
            call()
        assert err.value.status == 404 and err.value.code == "file_not_found"
    assert store.list("tenant-b")["data"] == [] and len(store.list("tenant-a")["data"]) == 1


def test_uploads_over_the_limits_are_413_and_a_wrong_purpose_400(root) -> None:
    store = FileStore(root, max_bytes=200, max_lines=2)
    with pytest.raises(APIError) as err:
        store.create(b"x" * 201, "big.jsonl", "batch", None)
    assert (err.value.status, err.value.code) == (413, "file_too_large")
    with pytest.raises(APIError) as err:
        store.create(b"{}\n{}\n\n{}\n", "many.jsonl", "batch", None)
    assert (err.value.status, err.value.code) == (413, "too_many_lines")
    with pytest.raises(APIError) as err:
        store.create(b"{}\n", "x.jsonl", "fine-tune", None)
    assert (err.value.status, err.value.param) == (400, "purpose")
    assert store.list(None)["data"] == []


def test_listing_pages_with_after_and_limit_in_either_order(root) -> None:
    store = FileStore(root)
    ids = [store.create(jsonl(line(str(i))), f"{i}.jsonl", "batch", None).id for i in range(5)]
    newest_first = [f["id"] for f in store.list(None)["data"]]
    assert sorted(newest_first) == sorted(ids)
    page = store.list(None, limit=2)
    assert [f["id"] for f in page["data"]] == newest_first[:2] and page["has_more"]
    rest = store.list(None, after=page["last_id"], limit=10)
    assert [f["id"] for f in rest["data"]] == newest_first[2:] and not rest["has_more"]
    assert [f["id"] for f in store.list(None, order="asc")["data"]] == newest_first[::-1]
    for bad in ({"order": "up"}, {"limit": 0}):
        with pytest.raises(APIError):
            store.list(None, **bad)


def test_files_outlive_the_store_and_every_process_sees_them_at_once(root) -> None:
    one, other = FileStore(root), FileStore(root)  # two replicas sharing the directory
    kept = one.create(jsonl(line("a")), "a.jsonl", "batch", None)
    assert other.content(kept.id, None) == one.content(kept.id, None)
    assert [f["id"] for f in other.list(None)["data"]] == [kept.id]
    other.delete(kept.id, None)
    with pytest.raises(APIError):
        one.get(kept.id, None)


def test_a_crash_mid_write_leaves_no_half_file(tmp_path) -> None:
    store = FileStore(tmp_path)
    kept = store.create(jsonl(line("a")), "a.jsonl", "batch", None)
    old = time.time() - 2 * 3600
    half = tmp_path / "files" / "file-0123"  # a write cut short: content, no object
    half.mkdir()
    (half / "content").write_bytes(b"half")
    os.utime(half / "content", (old, old))
    torn = tmp_path / "files" / kept.id / ".content.ab12.tmp"  # a temporary file a crash left
    torn.write_bytes(b"torn")
    os.utime(torn, (old, old))
    fresh = tmp_path / "files" / "file-4567"  # another process writing right now
    fresh.mkdir()
    (fresh / "content").write_bytes(b"new")
    FileStore(tmp_path)  # a start removes the temporary files a crash left an hour ago
    assert sorted(p.name for p in (tmp_path / "files" / kept.id).iterdir()) == ["content", "object.json"]
    # A listing (it reads every file's object) removes a content left without its object an hour
    # ago, never a write in progress.
    assert [f["id"] for f in store.list(None)["data"]] == [kept.id]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == sorted(["file-4567", kept.id])
    for bad in ("file-0123", "file-4567", "../files", "file-x/../../etc"):
        with pytest.raises(APIError):
            store.get(bad, None)


# ---- an input file's checks -----------------------------------------------------------------

def test_every_line_with_a_wrong_structure_is_named() -> None:
    content = jsonl(
        line("ok-1"),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),
        line("get", method="GET"),
        line("wrong-url", url="/v1/completions"),
        json.dumps({"custom_id": "no-body", "method": "POST", "url": CHAT}),
        line("ok-1"),
        "",
        line("ok-2"),
    )
    requests, errors = check_input(content, CHAT)
    assert [r.custom_id for r in requests] == ["ok-1", "ok-2"] and [r.line for r in requests] == [1, 10]
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "invalid_json_line"), (4, "missing_required_parameter"), (5, "invalid_method"),
        (6, "mismatched_url"), (7, "missing_required_parameter"), (8, "duplicate_custom_id")]
    assert errors[2]["param"] == "custom_id" and errors[5]["param"] == "body"


def test_a_file_of_bad_lines_lists_a_bounded_number_of_them() -> None:
    _, errors = check_input(b"x\n" * 1500, CHAT)
    assert len(errors) == 1001 and errors[999]["line"] == 1000
    assert errors[-1]["code"] == "too_many_errors" and errors[-1]["line"] == 1001 and "500 more" in errors[-1]["message"]


def test_an_empty_file_is_an_error_and_a_good_one_has_none() -> None:
    assert check_input(b"\n\n", CHAT) == ([], [{"code": "empty_file", "message": "The input file has no requests.",
                                                "param": None, "line": 1}])
    requests, errors = check_input(jsonl(line("a"), line("b")), CHAT)
    assert errors == [] and [r.body["messages"][0]["content"] for r in requests] == ["a", "b"]


# ---- the batch object -----------------------------------------------------------------------

def test_a_new_batch_checks_its_arguments() -> None:
    batch = new_batch(CHAT, "file-1", "24h", {"job": "eval"}, owner="t")
    obj = batch.to_openai()
    assert obj["object"] == "batch" and obj["status"] == "validating" and obj["errors"] is None
    assert obj["expires_at"] == obj["created_at"] + 24 * 3600 and obj["metadata"] == {"job": "eval"}
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    for kwargs, param in (({"endpoint": "/v1/images"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                          ({"metadata": {"k": 3}}, "metadata"), ({"metadata": {str(i): "v" for i in range(17)}},
                                                                 "metadata")):
        args = {"endpoint": CHAT, "input_file_id": "file-1", "completion_window": "24h", "metadata": None,
                "owner": None, **kwargs}
        with pytest.raises(APIError) as err:
            new_batch(**args)
        assert err.value.param == param


# ---- the journal ----------------------------------------------------------------------------

def test_answers_survive_a_restart_and_a_line_cut_short_is_run_again(tmp_path) -> None:
    record = new_batch(CHAT, "file-1", "24h", None, owner=None)
    record.total = 3
    journal = BatchJournal(tmp_path, record)
    record.enter("in_progress")
    journal.save()
    journal.append(answer_line(record.id, "a", 200, {"choices": []}))
    journal.append(answer_line(record.id, "b", 400, {"error": {"message": "bad"}}))
    assert (record.completed, record.failed) == (1, 1)
    with open(tmp_path / journal._answers, "ab") as f:  # a crash while the third answer was being written
        f.write(b'{"id": "batch_req_x", "custom_id": "c", "resp')
    reopened = BatchJournal(tmp_path, BatchJournal.load(tmp_path, record.id))
    assert reopened.record.status == "in_progress" and reopened.record.total == 3
    assert [r.id for r in BatchJournal.records(tmp_path)] == [record.id]
    assert set(reopened.answered()) == {"a", "b"}  # c runs again; a and b are not repeated
    assert (reopened.record.completed, reopened.record.failed) == (1, 1)
    reopened.append(answer_line(record.id, "c", 200, {"choices": []}))
    output, errors = reopened.split_answers(["c", "b", "a"])
    assert [json.loads(x)["custom_id"] for x in output.splitlines()] == ["c", "a"]
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()] == ["b"]
    assert json.loads(errors)["response"]["status_code"] == 400


def test_an_object_store_journal_keeps_each_answer_as_an_object_and_one_answer_per_request(root) -> None:
    record = new_batch(CHAT, "file-1", "24h", None, owner=None)
    journal = BatchJournal(root, record)
    journal.append(answer_line(record.id, "a", 200, {"choices": ["first"]}))
    journal.append(answer_line(record.id, "b", 200, {"choices": []}))
    # Two processes that both held the batch (a lease taken over from a holder still running) answer
    # "a" twice: the output keeps the first answer, the counts count it once.
    journal.append(answer_line(record.id, "a", 200, {"choices": ["second"]}))
    reopened = BatchJournal(root, record)
    assert list(reopened.answered()) == ["a", "b"] and reopened.record.completed == 2
    output, _ = reopened.split_answers(["a", "b"])
    assert [json.loads(x)["response"]["body"]["choices"] for x in output.splitlines()] == [["first"], []]
    reopened.remove_answers()
    assert BatchJournal(root, record).answered() == {}


def test_an_object_store_lease_keeps_a_key_in_one_process_until_released_or_run_out(monkeypatch) -> None:
    from service.batch import storage

    monkeypatch.setattr(storage, "LEASE_SETTLE_S", 0.0)
    url = f"memory://qkv-lease-{os.getpid()}-{time.monotonic_ns()}"
    one, other = FsspecStorage(url, lease_s=30.0), FsspecStorage(url, lease_s=30.0)  # two processes' views
    held = one.lock("batches/b.lock")
    assert held is not None and other.lock("batches/b.lock") is None
    held.release()
    assert not one.exists("batches/b.lock")  # released: removed, the next taker need not wait
    again = other.lock("batches/b.lock")
    assert again is not None and one.lock("batches/b.lock") is None
    # A holder that died leaves its lease; once it has run out, another process takes it over.
    lease = other.read_lease("batches/b.lock")
    other.put("batches/b.lock", json.dumps({**lease, "until": time.time() - 1}).encode())
    taken = one.lock("batches/b.lock")
    assert taken is not None and one.read_lease("batches/b.lock")["holder"] == one.holder
    again.release()  # the old holder, ending late, leaves the new holder's lease alone
    assert one.read_lease("batches/b.lock")["holder"] == one.holder and other.lock("batches/b.lock") is None
    taken.release()
    assert other.lock("batches/b.lock") is not None


def test_on_a_filesystem_that_writes_in_place_an_object_is_renamed_in_whole(tmp_path, monkeypatch) -> None:
    """fsspec's local filesystem writes a file in place (an object store's PUT does not): a reader
    of the batch's record while it is rewritten would read half of it, so it is renamed in."""
    store = FsspecStorage(f"local://{tmp_path}")
    written: list[str] = []
    pipe_file = store.fs.pipe_file
    monkeypatch.setattr(store.fs, "pipe_file",
                        lambda path, data, **kw: (written.append(path), pipe_file(path, data, **kw)))
    store.put("batches/b.json", b'{"status": "in_progress"}')
    assert written and not any(path.endswith("/batches/b.json") for path in written)  # never the final name
    assert store.get("batches/b.json") == b'{"status": "in_progress"}' and store.names("batches") == ["b.json"]


def test_a_request_that_never_ran_gets_an_error_line() -> None:
    line_ = answer_line("batch_1", "z", 0, None, error={"code": "batch_expired", "message": "expired"})
    assert line_["response"] is None and line_["error"]["code"] == "batch_expired" and line_["custom_id"] == "z"
