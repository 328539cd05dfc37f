"""Uploaded files (OpenAI's Files API, `purpose=batch`) and the files a batch writes, kept in a
store that outlives the process and that the replicas share (service/batch/storage.py: a
directory, or an object store through fsspec): each file is `files/{id}/content` (its bytes) and
`files/{id}/object.json` (its file object), the object written last and removed first, so a file
is there whole or not at all, for every process at once. Nothing is cached in memory: what one
replica stores, another reads at once.

Owners: a file belongs to the tenant that uploaded it (None: no API keys configured); another
tenant asking for it gets "no such file", as OpenAI answers for another organisation's ids.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from service.batch.storage import LEFT_BY_A_CRASH_S, LocalStorage, Storage, open_storage
from service.errors import APIError

PURPOSES = ("batch", "batch_output")  # what a client uploads; what a batch writes (output and error files)
UPLOAD_PURPOSES = ("batch",)
MAX_FILE_BYTES = 200 << 20  # OpenAI's limit on a batch input file
MAX_FILE_LINES = 50_000  # OpenAI's limit on the requests of one batch


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str | None
    lines: int  # non-empty lines: a batch input file's requests

    def to_openai(self) -> dict[str, Any]:
        """The file object of OpenAI's API."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def list_page(ordered: list[Any], after: str | None, limit: int, missing: Callable[[str], APIError]
              ) -> dict[str, Any]:
    """OpenAI's list object of `ordered` (records with `id` and `to_openai()`): those after the one
    whose id is `after` (`missing(after)` raised when there is none), at most `limit`."""
    if after is not None:
        ids = [r.id for r in ordered]
        if after not in ids:
            raise missing(after)
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": [r.to_openai() for r in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(ordered) > limit}


def no_such_file(file_id: str) -> APIError:
    return APIError(f"No such file: {file_id!r}.", status=404, param="file_id", code="file_not_found")


class FileStore:
    """Files by id under `files/` of `root` (a Storage, a directory or a URI); `max_bytes` and
    `max_lines` bound an upload (413 beyond)."""

    def __init__(self, root: str | Path | Storage, max_bytes: int = MAX_FILE_BYTES,
                 max_lines: int = MAX_FILE_LINES) -> None:
        self.storage = open_storage(root)
        self.max_bytes, self.max_lines = max_bytes, max_lines
        if isinstance(self.storage, LocalStorage):
            self.storage.remove_stale_temps("files")

    def create(self, content: bytes, filename: str, purpose: str, owner: str | None) -> FileRecord:
        """Store an upload; APIError 400 for an unknown purpose, 413 for a file over the limits."""
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}.", param="purpose")
        if len(content) > self.max_bytes:
            raise APIError(f"The file is {len(content)} bytes; at most {self.max_bytes} are accepted.", status=413,
                           param="file", code="file_too_large")
        lines = sum(1 for line in content.splitlines() if line.strip())
        if lines > self.max_lines:
            raise APIError(f"The file has {lines} requests (non-empty lines); at most {self.max_lines} are "
                           "accepted in one batch.", status=413, param="file", code="too_many_lines")
        return self.write(content, filename, purpose, owner, lines)

    def write(self, content: bytes, filename: str, purpose: str, owner: str | None, lines: int | None = None,
              file_id: str | None = None) -> FileRecord:
        """Store `content` (a batch's output or error file, or a checked upload); `file_id` names it
        (a batch's output files are named after the batch: written again after a restart, they
        replace themselves instead of leaving a second copy)."""
        if purpose not in PURPOSES:
            raise ValueError(f"unknown purpose {purpose!r}")
        record = FileRecord(id=file_id or f"file-{secrets.token_hex(12)}", bytes=len(content),
                            created_at=int(time.time()), filename=filename, purpose=purpose, owner=owner,
                            lines=lines if lines is not None else sum(1 for x in content.splitlines() if x.strip()))
        self.storage.put(f"files/{record.id}/content", content)
        self.storage.put(f"files/{record.id}/object.json", json.dumps(asdict(record)).encode())  # last: it is there now
        return record

    def get(self, file_id: str, owner: str | None) -> FileRecord:
        """The file, if `owner` may see it; else APIError 404."""
        record = self._read(file_id)
        if record is None or record.owner != owner:
            raise no_such_file(file_id)
        return record

    def content(self, file_id: str, owner: str | None) -> bytes:
        try:
            return self.storage.get(f"files/{self.get(file_id, owner).id}/content")
        except FileNotFoundError:  # deleted by another process between the two reads
            raise no_such_file(file_id) from None

    def delete(self, file_id: str, owner: str | None) -> dict[str, Any]:
        """Remove the file; OpenAI's deletion object."""
        record = self.get(file_id, owner)
        self.storage.remove(f"files/{record.id}/object.json")  # first: no reader sees the file from now on
        self.storage.remove_folder(f"files/{record.id}")
        return {"id": record.id, "object": "file", "deleted": True}

    def _read(self, file_id: str) -> FileRecord | None:
        if not file_id.startswith("file-") or "/" in file_id or file_id in (".", ".."):
            return None
        try:
            return FileRecord(**json.loads(self.storage.get(f"files/{file_id}/object.json")))
        except FileNotFoundError:
            return None

    def _read_or_sweep(self, name: str) -> FileRecord | None:
        """The file `name`; a content without its object (a crash between the two writes) is
        removed once it is an hour old. Listing reads every object anyway, so the sweep costs one
        more request only for such a leftover (not one per file at every start)."""
        record = self._read(name)
        if record is None:
            age = self.storage.age(f"files/{name}/content")
            if age is not None and age > LEFT_BY_A_CRASH_S:
                self.storage.remove_folder(f"files/{name}")
        return record

    def list(self, owner: str | None, purpose: str | None = None, after: str | None = None, limit: int = 10_000,
             order: str = "desc") -> dict[str, Any]:
        """OpenAI's list object of `owner`'s files, newest first (`order="desc"`) or oldest first,
        those after the file `after` in that order, at most `limit`."""
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        if not 1 <= limit <= 10_000:
            raise APIError(f"limit must be between 1 and 10000, got {limit}.", param="limit")
        records = (self._read_or_sweep(name) for name in self.storage.names("files") if name.startswith("file-"))
        mine = [r for r in records if r is not None and r.owner == owner and purpose in (None, r.purpose)]
        mine.sort(key=lambda r: (r.created_at, r.id), reverse=order == "desc")
        return list_page(mine, after, limit, no_such_file)
