"""The stored responses of one engine replica: what `GET /v1/responses/{id}` answers and what
`previous_response_id` continues from.

Bounded twice, least recently used first out: by count (`MAX_STORED_RESPONSES`) and by the
JSON size of what is kept (`MAX_STORED_BYTES`). An entry keeps its own input items and output
items and the id of the response it continued, so a conversation costs its length once, not
once per turn; reading an entry refreshes the responses it continues, so a live conversation is
not evicted from the middle. The store lives in the replica's memory: it is lost on restart and
not shared between replicas.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 << 20
MAX_CHAIN = 10_000  # previous_response_id links followed at most (a cycle cannot form; a bound anyway)


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as it was returned
    input_items: list[dict[str, Any]]  # this request's own input items (not its predecessors')
    previous_id: str | None
    size: int


class MissingResponse(KeyError):
    """A response id that is not (or no longer) stored."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


class ResponseStore:
    """An LRU map from response id to `StoredResponse`, bounded by count and bytes."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # routes run on one event loop; the lock keeps it safe anyway

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, body: dict[str, Any], input_items: list[dict[str, Any]], previous_id: str | None) -> bool:
        """Keep a finished response; False when it alone is larger than the whole store."""
        size = len(json.dumps(body)) + len(json.dumps(input_items))
        if size > self.max_bytes:
            logger.warning("response %s (%d bytes) exceeds the store's %d bytes: not stored",
                           body["id"], size, self.max_bytes)
            return False
        with self._lock:
            self._drop(body["id"])
            self._entries[body["id"]] = StoredResponse(body, input_items, previous_id, size)
            self._bytes += size
            while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
                oldest = next(iter(self._entries))
                self._drop(oldest)
        return True

    def get(self, response_id: str) -> StoredResponse:
        """The stored response (refreshed); raises MissingResponse."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise MissingResponse(response_id)
            self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> None:
        """Forget a response; raises MissingResponse."""
        with self._lock:
            if response_id not in self._entries:
                raise MissingResponse(response_id)
            self._drop(response_id)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """Every input and output item of the conversation that ends with `response_id`, oldest
        first; raises MissingResponse naming the first response of the chain that is gone."""
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None and len(chain) < MAX_CHAIN:
            entry = self.get(next_id)
            chain.append(entry)
            next_id = entry.previous_id
        items: list[dict[str, Any]] = []
        for entry in reversed(chain):
            items.extend(entry.input_items)
            items.extend(entry.body["output"])
        return items

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
