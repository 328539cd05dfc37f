"""Running batches: what `POST /v1/batches`, `GET /v1/batches[/{id}]` and `.../cancel` do, and
`run`, which takes a batch from `validating` to its end, its requests sent through `send` (in the
service: the interactive endpoint of the batch, at the lowest priority), so that a line gets
exactly the answer, or the error, the endpoint would give it.

Several processes (the replicas) may share the store: every call reads the batch as last saved,
and a batch runs in the one process that holds its lock (`batches/{id}.lock`: an OS file lock in
a directory, given back when the run ends or the process dies; a lease in an object store, taken
over once a dead holder's has run out). A cancel that reaches another process leaves a marker
(`batches/{id}.cancel`) that the running one reads before each request.

A batch of at least `offline.min_lines` requests may run elsewhere (`Offline`: a Ray Data job in
the service, service/offline/batch_job.py), its answers recorded here as they come, with the same
journal, cancellation and expiry.

A batch whose process stopped resumes where its journal ends (service/batch/batches.py): the
requests already answered are not sent again. An error raised by `send` itself (not an answer:
the engine gone, the process stopping) ends `run` without recording that request, which the next
`run` sends again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from service.batch.batches import TERMINAL, BatchJournal, BatchRecord, answer_line, check_input, line_outcome, new_batch
from service.batch.files import FileStore, list_page
from service.batch.storage import Storage, open_storage
from service.errors import APIError

SAVE_EVERY_S = 0.5  # how stale the counts another process reads may be while a batch runs (the journal is exact)
RECORDING_PER_SLOT = 4  # answers that may wait to be written, per request in flight

# (endpoint, request body, owner) -> (HTTP status, JSON body) of the endpoint's answer.
Send = Callable[[str, dict[str, Any], str | None], Awaitable[tuple[int, dict[str, Any]]]]
# (custom_id, HTTP status, JSON body) of one answer an `Offline` run gives.
Answer = tuple[str, int, dict[str, Any]]


class Offline(Protocol):
    """Where a batch of at least `min_lines` requests runs instead of through `send`."""

    min_lines: int

    def takes(self, owner: str | None) -> bool:
        """Whether `owner`'s batch may run there (no: it runs through `send`)."""

    def answers(self, endpoint: str, requests: list[tuple[str, dict[str, Any]]],
                owner: str | None) -> AsyncGenerator[Answer | None, None]:
        """Each request's answer as it comes, in any order, and None now and then while none
        comes (so that the runner can look for a cancel); closing the iterator stops the run."""


def no_such_batch(batch_id: str) -> APIError:
    return APIError(f"No such batch: {batch_id!r}.", status=404, param="batch_id", code="batch_not_found")


class BatchRunner:
    """The batches kept under `root` (a Storage, a directory or a URI), their files in `files`; at
    most `concurrency` requests of a batch in flight at once. `clock`: seconds since the epoch
    (tests move it). `on_line(outcome)`: called for each line this process records
    (`line_outcome`: completed, failed, expired). `offline`: where large batches run (None: every
    batch runs through `send`)."""

    def __init__(self, root: str | Path | Storage, files: FileStore, send: Send, concurrency: int = 4,
                 clock: Callable[[], float] = time.time, on_line: Callable[[str], None] | None = None,
                 offline: Offline | None = None) -> None:
        self.root, self.files, self.send = open_storage(root), files, send
        self.concurrency, self.clock, self.on_line, self.offline = concurrency, clock, on_line, offline
        self._offline_failed: set[str] = set()  # batches whose offline run failed here: they go on through `send`

    # ---- the API's calls ---------------------------------------------------------------------

    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: Any,
               owner: str | None) -> BatchRecord:
        """A new batch over `owner`'s input file (404 for a file that is not theirs, 400 for one
        that is not a batch input file); `run` takes it from there."""
        record = self.files.get(input_file_id, owner)
        if record.purpose != "batch":
            raise APIError(f"File {input_file_id!r} has purpose {record.purpose!r}; a batch reads a file uploaded "
                           "with purpose 'batch'.", param="input_file_id")
        batch = new_batch(endpoint, input_file_id, completion_window, metadata, owner)
        BatchJournal(self.root, batch).save()
        return batch

    def get(self, batch_id: str, owner: str | None) -> BatchRecord:
        record = BatchJournal.load(self.root, batch_id)
        if record is None or record.owner != owner:
            raise no_such_batch(batch_id)
        return record

    def list(self, owner: str | None, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """OpenAI's list of `owner`'s batches, newest first, those after `after`, at most `limit`."""
        if not 1 <= limit <= 100:
            raise APIError(f"limit must be between 1 and 100, got {limit}.", param="limit")
        mine = sorted((r for r in BatchJournal.records(self.root) if r.owner == owner),
                      key=lambda r: (r.created_at, r.id), reverse=True)
        return list_page(mine, after, limit, no_such_batch)

    def cancel(self, batch_id: str, owner: str | None) -> BatchRecord:
        """Ask a batch to stop: `cancelling` until the requests in flight are answered, then
        `cancelled` with the answers so far. 409 for a batch that has ended."""
        record = self.get(batch_id, owner)
        if record.status in TERMINAL:
            raise APIError(f"Batch {batch_id!r} has status {record.status!r} and cannot be cancelled.", status=409,
                           code="batch_not_cancellable")
        self.root.put(f"batches/{batch_id}.cancel", b"")
        with self._hold(batch_id) as held:
            if held:  # nobody runs it: say so in its record now (a running process does it itself)
                record = BatchJournal.load(self.root, batch_id) or record
                if record.status not in TERMINAL:
                    self._cancelling(BatchJournal(self.root, record))
        if record.status not in TERMINAL:
            record.enter("cancelling", record.times.get("cancelling", self.clock()))
        return record

    def pending(self) -> list[str]:
        """Batches not ended, oldest first: what a runner loop takes next."""
        return [r.id for r in sorted((r for r in BatchJournal.records(self.root) if r.status not in TERMINAL),
                                     key=lambda r: (r.created_at, r.id))]

    # ---- running -----------------------------------------------------------------------------

    async def run(self, batch_id: str) -> BatchRecord | None:
        """Take the batch to its end: validate its input (failed, every bad line named, when the
        structure is wrong), send each request not yet answered, then write the output and error
        files. Stops early, ending the batch accordingly, when it is cancelled or its window ends.
        None when another process runs it. The store is read and written off the event loop (an
        object store answers over the network)."""
        lock = await asyncio.to_thread(self.root.lock, f"batches/{batch_id}.lock")
        if lock is None:
            return None
        try:
            record = await asyncio.to_thread(BatchJournal.load, self.root, batch_id)
            if record is None:
                raise no_such_batch(batch_id)
            return await self._run(BatchJournal(self.root, record))
        finally:
            await asyncio.to_thread(lock.release)

    @contextmanager
    def _hold(self, batch_id: str) -> Iterator[bool]:
        """The batch's lock, if no other process holds it (True inside), for as long as the block runs."""
        lock = self.root.lock(f"batches/{batch_id}.lock")
        try:
            yield lock is not None
        finally:
            if lock is not None:
                lock.release()

    def _cancelled(self, journal: BatchJournal) -> bool:
        """Whether the batch is to stop (its record says so, or a cancel left its marker)."""
        if journal.record.status == "cancelling":
            return True
        if self.root.exists(f"batches/{journal.record.id}.cancel"):
            self._cancelling(journal)
            return True
        return False

    def _cancelling(self, journal: BatchJournal) -> None:
        journal.record.enter("cancelling", self.clock())
        journal.save()

    async def _run(self, journal: BatchJournal) -> BatchRecord:
        record = journal.record
        if record.status in TERMINAL:
            return record
        try:
            content = await asyncio.to_thread(self.files.content, record.input_file_id, record.owner)
        except APIError:
            return await asyncio.to_thread(self._fail, journal, [{
                "code": "file_not_found", "message": f"The input file {record.input_file_id!r} was deleted.",
                "param": "input_file_id", "line": None}])
        requests, errors = check_input(content, record.endpoint)
        if record.status == "validating" and not await asyncio.to_thread(self._cancelled, journal):
            if errors:
                return await asyncio.to_thread(self._fail, journal, errors)
            record.total = len(requests)
            record.enter("in_progress", self.clock())
            await asyncio.to_thread(journal.save)
        done = await asyncio.to_thread(journal.answered)
        todo = [r for r in requests if r.custom_id not in done]
        # Decided by the whole batch's size, so that a resumed batch runs where it started; but a
        # batch whose offline run failed in this process goes on here (a job that cannot run, such as
        # a model its actors cannot load, would otherwise be started again at every pass).
        if (self.offline is not None and len(requests) >= self.offline.min_lines
                and record.id not in self._offline_failed and self.offline.takes(record.owner)):
            try:
                await self._run_offline(journal, todo)
            except Exception:
                self._offline_failed.add(record.id)
                raise
            return await asyncio.to_thread(self._end, journal, requests)
        limit = asyncio.Semaphore(self.concurrency)
        saved = [time.monotonic()]

        recording = asyncio.Semaphore(RECORDING_PER_SLOT * self.concurrency)
        failed: list[BaseException] = []  # a `send` that raised: no request is sent after it

        async def one(request) -> None:
            async with limit:
                if failed or self.clock() >= record.expires_at or await asyncio.to_thread(self._cancelled, journal):
                    return
                try:
                    status, body = await self.send(record.endpoint, request.body, record.owner)
                except Exception as exc:
                    failed.append(exc)
                    return
                await recording.acquire()  # a store slower than the engine holds the batch back here
            # The slot goes to the next request as soon as this answer is in (an engine row left idle
            # while the line is written costs throughput); the line counts as done once written, off
            # the event loop that serves interactive requests (an fsync, or an object store's PUT).
            try:
                await asyncio.to_thread(self._record, journal, answer_line(record.id, request.custom_id, status, body))
                if time.monotonic() - saved[0] >= SAVE_EVERY_S:  # the counts, for every process that reads the batch
                    saved[0] = time.monotonic()
                    await asyncio.to_thread(journal.save)
            finally:
                recording.release()

        try:
            # Every task ends before this returns (no answer is written after the batch's lock is
            # given back); the first `send` error then ends the run.
            await asyncio.gather(*(one(r) for r in todo))
        finally:  # the counts as the journal has them, also when `send` failed (a killed process's catch up on resume)
            await asyncio.to_thread(journal.save)
        if failed:
            raise failed[0]
        return await asyncio.to_thread(self._end, journal, requests)

    async def _run_offline(self, journal: BatchJournal, todo: list) -> None:
        """The requests of `todo` through `self.offline`, each answer recorded as it comes; the run
        is closed (what it has in flight dropped, to be sent again on resume) when the batch is
        cancelled or expires. An error of the run ends this, as a `send` error does."""
        record = journal.record
        assert self.offline is not None
        if not todo:  # every request answered before a restart: no job to start
            return
        stream = self.offline.answers(record.endpoint, [(r.custom_id, r.body) for r in todo], record.owner)
        saved = time.monotonic()
        try:
            async for answer in stream:
                if answer is not None:
                    custom_id, status, body = answer
                    await asyncio.to_thread(self._record, journal, answer_line(record.id, custom_id, status, body))
                if time.monotonic() - saved >= SAVE_EVERY_S:
                    saved = time.monotonic()
                    await asyncio.to_thread(journal.save)
                    if self.clock() >= record.expires_at or await asyncio.to_thread(self._cancelled, journal):
                        break
        finally:
            await stream.aclose()
            await asyncio.to_thread(journal.save)

    def _end(self, journal: BatchJournal, requests: list) -> BatchRecord:
        """After the requests: cancelled, expired (an error line for each request not run) or
        completed, with the output and error files."""
        record = journal.record
        if self._cancelled(journal):
            end = "cancelled"
        elif self.clock() >= record.expires_at and len(answered := journal.answered()) < len(requests):
            end = "expired"
            for request in requests:
                if request.custom_id not in answered:
                    self._record(journal, answer_line(record.id, request.custom_id, 0, None, error={
                        "code": "batch_expired", "message": "This request could not be run before the batch "
                                                            "expired."}))
        else:
            end = "completed"
        return self._finish(journal, [r.custom_id for r in requests], end)

    def _record(self, journal: BatchJournal, line: dict[str, Any]) -> None:
        journal.append(line)
        if self.on_line is not None:
            self.on_line(line_outcome(line))

    def _fail(self, journal: BatchJournal, errors: list[dict[str, Any]]) -> BatchRecord:
        journal.record.errors = errors
        journal.record.enter("failed", self.clock())
        journal.save()
        return journal.record

    def _finish(self, journal: BatchJournal, order: list[str], end: str) -> BatchRecord:
        """Split the answers into the output and error files (named after the batch, so a restart
        that finalises again replaces them), then the batch's end status."""
        record = journal.record
        if record.status != "cancelling":
            record.enter("finalizing", self.clock())
            journal.save()
        output, errors = journal.split_answers(order)
        if output:
            record.output_file_id = self.files.write(output, f"{record.id}_output.jsonl", "batch_output",
                                                     record.owner, file_id=f"file-{record.id}-output").id
        if errors:
            record.error_file_id = self.files.write(errors, f"{record.id}_error.jsonl", "batch_output",
                                                    record.owner, file_id=f"file-{record.id}-error").id
        record.enter(end, self.clock())
        journal.save()
        journal.remove_answers()
        self.root.remove(f"batches/{record.id}.cancel")
        return record
