"""Batches (OpenAI's Batch API): an input file's checks, the batch object and its statuses, and the
journal that makes a batch survive a restart.

Statuses, as OpenAI has them: validating -> in_progress -> finalizing -> completed; failed (the
input file's structure is wrong: every bad line is named in `errors`); cancelling -> cancelled;
expired (the completion window ran out; the lines not answered get a `batch_expired` error line).

The journal, written by the one process that holds the batch while it runs: its answers are
recorded, one JSON line per request, in `batches/{id}.answers.jsonl` (service/batch/storage.py:
appended and fsynced in a directory, an object per line in an object store), each line durable
before the request counts as done. The answers are the only record of which requests are done:
a restart reads them back (dropping a last line cut short by a crash, whose request is then run
again), so no request's answer is lost, and each custom_id is answered once in the output (its
first answer kept). The batch object (`batches/{id}.json`) is rewritten whole, atomically, on each
change, for every process to read. When every request is
answered, the answers are split into the output file (status 200) and the error file (the rest),
stored as files of purpose `batch_output`.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from service.batch.storage import Storage, open_storage
from service.errors import APIError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = ("completed", "failed", "cancelled", "expired")
STATUSES = ("validating", "in_progress", "finalizing", "cancelling", *TERMINAL)  # OpenAI's
MAX_LISTED_ERRORS = 1000  # `errors.data` names at most this many bad lines


@dataclass(frozen=True)
class BatchRequest:
    """One line of an input file that passed the checks."""

    line: int  # 1-based, as OpenAI's errors name lines
    custom_id: str
    body: dict[str, Any]


def line_error(line: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def check_input(content: bytes, endpoint: str) -> tuple[list[BatchRequest], list[dict[str, Any]]]:
    """The requests of a batch input file, and one error per line whose structure is wrong (as
    OpenAI fails a batch at validation): not a JSON object, no `custom_id`, `method` other than
    POST, a `url` other than the batch's endpoint, no object `body`, a `custom_id` seen before.
    An empty file is an error too. Whether a body is a valid request is the endpoint's to say,
    request by request, when the batch runs."""
    requests: list[BatchRequest] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            errors.append(line_error(number, "invalid_json_line", f"Line {number} is not valid JSON: {exc}."))
            continue
        if not isinstance(item, dict):
            errors.append(line_error(number, "invalid_json_line", f"Line {number} is not a JSON object."))
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            errors.append(line_error(number, "missing_required_parameter",
                                     f"Line {number} has no custom_id (a non-empty string).", "custom_id"))
            continue
        if item.get("method") != "POST":
            errors.append(line_error(number, "invalid_method", f"Line {number}: method must be 'POST', got "
                                     f"{item.get('method')!r}.", "method"))
            continue
        if item.get("url") != endpoint:
            errors.append(line_error(number, "mismatched_url", f"Line {number}: url {item.get('url')!r} is not "
                                     f"the batch's endpoint {endpoint!r}.", "url"))
            continue
        if not isinstance(item.get("body"), dict):
            errors.append(line_error(number, "missing_required_parameter",
                                     f"Line {number} has no body (a JSON object).", "body"))
            continue
        if custom_id in seen:
            errors.append(line_error(number, "duplicate_custom_id",
                                     f"Line {number}: custom_id {custom_id!r} appears on an earlier line.",
                                     "custom_id"))
            continue
        seen.add(custom_id)
        requests.append(BatchRequest(number, custom_id, item["body"]))
    if not requests and not errors:
        errors.append(line_error(1, "empty_file", "The input file has no requests."))
    if len(errors) > MAX_LISTED_ERRORS:  # the batch object carries them: a bounded list, and how many more
        more = len(errors) - MAX_LISTED_ERRORS
        errors = errors[:MAX_LISTED_ERRORS] + [line_error(errors[MAX_LISTED_ERRORS]["line"], "too_many_errors",
                                                          f"{more} more lines have errors; the first is named.")]
    return requests, errors


@dataclass
class BatchRecord:
    """A batch's state, as its JSON file keeps it; `to_openai` gives the batch object."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    owner: str | None
    created_at: int
    metadata: dict[str, str] | None = None
    status: str = "validating"
    errors: list[dict[str, Any]] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    times: dict[str, int] = field(default_factory=dict)  # status -> when it was entered

    @property
    def expires_at(self) -> int:
        return self.created_at + COMPLETION_WINDOWS[self.completion_window]

    def enter(self, status: str, now: float | None = None) -> None:
        self.status = status
        self.times[status] = int(now if now is not None else time.time())

    def to_openai(self) -> dict[str, Any]:
        stamp = {s: self.times.get(s) for s in ("in_progress", "finalizing", "completed", "failed", "expired",
                                                 "cancelling", "cancelled")}
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": None if self.errors is None else {"object": "list", "data": self.errors},
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{f"{s}_at": t for s, t in stamp.items()},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}


def new_batch(endpoint: str, input_file_id: str, completion_window: str, metadata: Any, owner: str | None
              ) -> BatchRecord:
    """A batch as `POST /v1/batches` creates it, its arguments checked (APIError 400 naming the
    argument otherwise)."""
    if endpoint not in ENDPOINTS:
        raise APIError(f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}.", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise APIError(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {completion_window!r}.",
                       param="completion_window")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16
                                 or any(not isinstance(k, str) or len(k) > 64 or not isinstance(v, str)
                                        or len(v) > 512 for k, v in metadata.items())):
        raise APIError("metadata must be an object of at most 16 string keys (64 characters at most) to string "
                       "values (512 characters at most).", param="metadata")
    return BatchRecord(id=f"batch_{secrets.token_hex(12)}", endpoint=endpoint, input_file_id=input_file_id,
                       completion_window=completion_window, owner=owner, created_at=int(time.time()),
                       metadata=metadata)


def answer_line(batch_id: str, custom_id: str, status_code: int, body: dict[str, Any] | None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape: the endpoint's answer (`response`)
    or, for a request that never ran (the batch expired or was cancelled), `error`."""
    response = None if body is None else {"status_code": status_code,
                                          "request_id": f"req_{secrets.token_hex(8)}", "body": body}
    return {"id": f"batch_req_{secrets.token_hex(8)}", "custom_id": custom_id, "response": response, "error": error}


class BatchJournal:
    """A batch's record and answers under `batches/` of `root` (a Storage, a directory or a URI)."""

    def __init__(self, root: str | Path | Storage, record: BatchRecord) -> None:
        """Only the process that holds the batch (service/batch/runner.py's lock) writes through it."""
        self.storage = open_storage(root)
        self.record = record
        self._lock = threading.Lock()
        self._answers = f"batches/{record.id}.answers.jsonl"

    @staticmethod
    def load(root: str | Path | Storage, batch_id: str) -> BatchRecord | None:
        """The batch's record as last saved, or None when there is no such batch."""
        if not batch_id.startswith("batch_") or "/" in batch_id:
            return None
        try:
            return BatchRecord(**json.loads(open_storage(root).get(f"batches/{batch_id}.json")))
        except FileNotFoundError:
            return None

    @staticmethod
    def records(root: str | Path | Storage) -> list[BatchRecord]:
        """Every batch kept under `root`, as last saved."""
        storage = open_storage(root)
        found = (BatchJournal.load(storage, name[:-len(".json")]) for name in storage.names("batches")
                 if name.startswith("batch_") and name.endswith(".json"))
        return [r for r in found if r is not None]

    @staticmethod
    def status_counts(root: str | Path | Storage) -> dict[str, int]:
        """How many batches under `root` have each status (every status, 0 where none has it)."""
        counts = dict.fromkeys(STATUSES, 0)
        for record in BatchJournal.records(root):
            counts[record.status] = counts.get(record.status, 0) + 1
        return counts

    def save(self) -> None:
        """The record, whole, atomically."""
        self.storage.put(f"batches/{self.record.id}.json", json.dumps(asdict(self.record)).encode())

    def answered(self) -> dict[str, dict[str, Any]]:
        """custom_id -> its answer line (the first recorded for it), from the journal; a line a crash
        cut short is dropped (its request runs again). Counts follow."""
        with self._lock:
            data = self.storage.read_journal(self._answers)
        done: dict[str, dict[str, Any]] = {}
        for raw in data.splitlines():
            if raw.strip():
                line = json.loads(raw)
                done.setdefault(line["custom_id"], line)
        self.record.completed = sum(1 for x in done.values() if _succeeded(x))
        self.record.failed = len(done) - self.record.completed
        return done

    def append(self, line: dict[str, Any]) -> None:
        """Record one request's answer, durably before this returns (the request counts as done
        from then on)."""
        data = (json.dumps(line) + "\n").encode()
        with self._lock:
            self.storage.append(self._answers, data)
            if _succeeded(line):
                self.record.completed += 1
            else:
                self.record.failed += 1

    def split_answers(self, order: list[str]) -> tuple[bytes, bytes]:
        """The output file (answers with status 200) and the error file (the rest), each in the
        input file's order (`order`: its custom_ids)."""
        done = self.answered()
        out, err = [], []
        for custom_id in order:
            line = done.get(custom_id)
            if line is not None:
                (out if _succeeded(line) else err).append(json.dumps(line) + "\n")
        return "".join(out).encode(), "".join(err).encode()

    def remove_answers(self) -> None:
        self.storage.remove_journal(self._answers)


def line_outcome(line: dict[str, Any]) -> str:
    """`completed` (answered 200), `expired` (never ran: the window ended) or `failed`, as the
    batch's request_counts and the lines metric count them."""
    if _succeeded(line):
        return "completed"
    return "expired" if (line.get("error") or {}).get("code") == "batch_expired" else "failed"


def _succeeded(line: dict[str, Any]) -> bool:
    return line.get("error") is None and (line.get("response") or {}).get("status_code") == 200
