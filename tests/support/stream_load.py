"""Closed-loop streaming load in threads, recording each request's send and end times and how it
ended: what the node-loss test and benchmark keep running while they take a node away.

Each client sends a streamed `/v1/completions` (`ignore_eos`, exactly `max_tokens` tokens), reads it
to its end and sends the next, until `stop()`. A request counts as served only when its stream
carried every token and `[DONE]`; anything else (a status other than 200, an error event, a
connection closed early, the client's hang bound) is recorded with its reason, never raised.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import requests

from loadtests.lib.openai_workload import RequestResult, StreamError, read_stream


@dataclass
class Outcome:
    """One request: when it was sent and ended (time.time()), whether it was served, and why not."""

    client: int
    sent: float
    ended: float
    ok: bool
    status: int
    error: str | None
    hung: bool = False  # it reached the client's hang bound


class StreamLoad:
    """`clients` threads sending streamed completions to `url` back to back."""

    def __init__(self, url: str, clients: int, max_tokens: int, hang_bound_s: float = 120,
                 fresh_prefixes: bool = False) -> None:
        """`fresh_prefixes`: each prompt starts with its own number, so that no replica holds its
        first block and a prefix-aware router places it by load alone (otherwise a client's prompts
        share their first block, and the router keeps them where that block is)."""
        self.url, self.clients, self.max_tokens, self.hang_bound_s = url, clients, max_tokens, hang_bound_s
        self.fresh_prefixes = fresh_prefixes
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> StreamLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending and wait for every request in flight to end (each is bounded by the hang bound)."""
        self._stop.set()
        for t in self._threads:
            t.join(self.hang_bound_s + 30)
        assert not any(t.is_alive() for t in self._threads), "a load client outlived its hang bound"

    def served_since(self, since: float) -> int:
        """How many requests sent at or after `since` were served."""
        with self._lock:
            return sum(o.ok and o.sent >= since for o in self.outcomes)

    def _loop(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = (f"{n:06d}/{client} " if self.fresh_prefixes else f"client {client} request {n}: ") + \
                "the quick brown fox jumps over"
            outcome = self._one(client, prompt)
            with self._lock:
                self.outcomes.append(outcome)
            n += 1

    def _one(self, client: int, prompt: str) -> Outcome:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, status, error, hung = time.time(), 0, None, False
        result = RequestResult(scenario="load", stream=True, start=sent)
        try:
            with requests.post(f"{self.url}/v1/completions", json=body, stream=True,
                               timeout=(10, self.hang_bound_s)) as resp:
                status = resp.status_code
                if status != 200:
                    error = f"HTTP {status}: {resp.text[:200]}"
                else:
                    read_stream(resp.iter_lines(), result, time.perf_counter())
                    if result.completion_tokens != self.max_tokens:
                        error = f"{result.completion_tokens} of {self.max_tokens} tokens"
        except StreamError as exc:
            error = f"stream: {exc}"
        except requests.Timeout as exc:
            error, hung = f"hang bound: {exc}", True
        except requests.RequestException as exc:  # a connection closed or refused
            error = f"connection: {type(exc).__name__}: {exc}"[:300]
        return Outcome(client, sent, time.time(), error is None, status, error, hung)
