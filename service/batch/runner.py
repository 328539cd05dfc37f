"""Running batches: what `POST /v1/batches`, `GET /v1/batches[/{id}]` and `.../cancel` do, and
the loop that takes a batch from `validating` to its end, its requests sent through `send` (in
the service: the interactive endpoint of the batch, at the lowest priority), so that a line gets
exactly the answer, or the error, the endpoint would give it.

A batch whose process stopped resumes where its journal ends (service/batch/batches.py): the
requests already answered are not sent again. An error raised by `send` itself (not an answer:
the engine gone, the process stopping) ends `run` without recording that request, which the next
`run` sends again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from service.batch.batches import TERMINAL, BatchJournal, BatchRecord, answer_line, check_input, new_batch
from service.batch.files import FileStore
from service.errors import APIError

# (endpoint, request body, owner) -> (HTTP status, JSON body) of the endpoint's answer.
Send = Callable[[str, dict[str, Any], str | None], Awaitable[tuple[int, dict[str, Any]]]]


def no_such_batch(batch_id: str) -> APIError:
    return APIError(f"No such batch: {batch_id!r}.", status=404, param="batch_id", code="batch_not_found")


class BatchRunner:
    """The batches kept under `root`, their files in `files`; at most `concurrency` requests of a
    batch in flight at once. `clock`: seconds since the epoch (tests move it)."""

    def __init__(self, root: str | Path, files: FileStore, send: Send, concurrency: int = 4,
                 clock: Callable[[], float] = time.time) -> None:
        self.root, self.files, self.send = Path(root), files, send
        self.concurrency, self.clock = concurrency, clock
        self.journals: dict[str, BatchJournal] = {j.record.id: j for j in BatchJournal.open_all(root)}

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
        journal = BatchJournal(self.root, batch)
        journal.save()
        self.journals[batch.id] = journal
        return batch

    def get(self, batch_id: str, owner: str | None) -> BatchRecord:
        journal = self.journals.get(batch_id)
        if journal is None or journal.record.owner != owner:
            raise no_such_batch(batch_id)
        return journal.record

    def list(self, owner: str | None, after: str | None = None, limit: int = 20) -> dict[str, Any]:
        """OpenAI's list of `owner`'s batches, newest first, those after `after`, at most `limit`."""
        if not 1 <= limit <= 100:
            raise APIError(f"limit must be between 1 and 100, got {limit}.", param="limit")
        mine = sorted((j.record for j in self.journals.values() if j.record.owner == owner),
                      key=lambda r: (r.created_at, r.id), reverse=True)
        if after is not None:
            ids = [r.id for r in mine]
            if after not in ids:
                raise no_such_batch(after)
            mine = mine[ids.index(after) + 1:]
        page = mine[:limit]
        return {"object": "list", "data": [r.to_openai() for r in page], "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None, "has_more": len(mine) > limit}

    def cancel(self, batch_id: str, owner: str | None) -> BatchRecord:
        """Ask a batch to stop: `cancelling` until the requests in flight are answered, then
        `cancelled` with the answers so far. 409 for a batch that has ended."""
        record = self.get(batch_id, owner)
        if record.status in TERMINAL:
            raise APIError(f"Batch {batch_id!r} has status {record.status!r} and cannot be cancelled.", status=409,
                           code="batch_not_cancellable")
        if record.status != "cancelling":
            record.enter("cancelling", self.clock())
            self.journals[batch_id].save()
        return record

    def pending(self) -> list[str]:
        """Batches not ended, oldest first: what a runner loop takes next."""
        return [r.id for r in sorted((j.record for j in self.journals.values() if j.record.status not in TERMINAL),
                                     key=lambda r: (r.created_at, r.id))]

    # ---- running -----------------------------------------------------------------------------

    async def run(self, batch_id: str) -> BatchRecord:
        """Take the batch to its end: validate its input (failed, every bad line named, when the
        structure is wrong), send each request not yet answered, then write the output and error
        files. Stops early, ending the batch accordingly, when it is cancelled or its window ends."""
        journal = self.journals[batch_id]
        record = journal.record
        if record.status in TERMINAL:
            return record
        try:
            content = self.files.content(record.input_file_id, record.owner)
        except APIError:
            return self._fail(journal, [{"code": "file_not_found", "message": f"The input file "
                                         f"{record.input_file_id!r} was deleted.", "param": "input_file_id",
                                         "line": None}])
        requests, errors = check_input(content, record.endpoint)
        if record.status == "validating":
            if errors:
                return self._fail(journal, errors)
            record.total = len(requests)
            record.enter("in_progress", self.clock())
            journal.save()
        done = journal.answered()
        todo = [r for r in requests if r.custom_id not in done]
        limit = asyncio.Semaphore(self.concurrency)

        async def one(request) -> None:
            async with limit:
                if record.status == "cancelling" or self.clock() >= record.expires_at:
                    return
                status, body = await self.send(record.endpoint, request.body, record.owner)
                journal.append(answer_line(record.id, request.custom_id, status, body))

        await asyncio.gather(*(one(r) for r in todo))
        if record.status == "cancelling":
            end = "cancelled"
        elif self.clock() >= record.expires_at and len(journal.answered()) < len(requests):
            end = "expired"
            answered = journal.answered()
            for request in requests:
                if request.custom_id not in answered:
                    journal.append(answer_line(record.id, request.custom_id, 0, None, error={
                        "code": "batch_expired", "message": "This request could not be run before the batch "
                                                            "expired."}))
        else:
            end = "completed"
        return self._finish(journal, [r.custom_id for r in requests], end)

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
        return record
