"""Streaming clients against a running service: a small keep-alive HTTP/1.1 client that reads a
streamed `/v1/completions` answer's SSE chunks as they come, and closed-loop runs of such clients
(each sends its next request when the last one ended) with TTFT, inter-chunk latency and
tokens/s."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p99 and mean of `values` (NaN for none)."""
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


class Connection:
    """One client's keep-alive HTTP/1.1 connection, reading a streamed response's chunks as they
    come: a small client, so that the clients, which share the machine's cores with the service
    (not with the bare engine), take as little of them as they can (httpx's line reader took
    about as much CPU per token as the whole serving path)."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
        """POST `body`; the SSE `data:` payloads of the answer as they arrive."""
        raw = json.dumps(body).encode()
        request = (f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw
        for attempt in (1, 2):  # a kept-alive connection the server closed meanwhile: once more on a new one
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
            self._writer.write(request)
            reader = self._reader
            status = (await reader.readline()).split(b" ", 2)
            if len(status) > 1 or attempt == 2:
                break
            await self.close()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        if status[1] != b"200":
            raise RuntimeError(f"HTTP {status[1].decode()}: {await reader.read(300)!r}")
        if headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"expected a chunked stream, got headers {headers}")
        pending = b""
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return
            pending += data[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:].decode()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None


async def stream_completion(conn: Connection, prompt: list[int], max_tokens: int,
                            model: str | None = None) -> dict[str, Any]:
    """One streamed greedy completion of `prompt`: when it was sent, when each chunk came, and the
    tokens the usage chunk counts."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    sent = time.perf_counter()
    chunk_times, usage = [], None
    async for data in conn.stream("/v1/completions", body):
        # Parsed only where needed (an error, the usage chunk): see `Connection`.
        if data == "[DONE]":
            continue
        if data.startswith('{"error"'):
            raise RuntimeError(f"stream error: {data[:300]}")
        if '"choices": []' not in data:
            chunk_times.append(time.perf_counter())
            continue
        usage = json.loads(data).get("usage") or usage
    return {"sent": sent, "chunks": chunk_times, "tokens": usage["completion_tokens"]}


async def closed_loop(url: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                      model: str | None = None) -> list[dict]:
    """`concurrency` clients, each on its own connection, taking the prompts in turn until none is
    left (after one warm-up request); each request's `stream_completion` result."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[dict] = []
    host, port = url.split("://", 1)[1].rsplit(":", 1)

    async def worker(conn: Connection) -> None:
        try:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await stream_completion(conn, prompts[i], max_tokens[i], model))
        finally:
            await conn.close()

    warm = Connection(host, int(port))
    await stream_completion(warm, prompts[0][:8], 4, model)  # warm-up
    await warm.close()
    await asyncio.gather(*(worker(Connection(host, int(port))) for _ in range(concurrency)))
    return results


def run_service(url: str, prompts: list[list[int]], max_tokens: list[int], concurrency: int,
                model: str | None = None) -> dict[str, Any]:
    """`concurrency` streaming clients over the prompts (each request naming `model`, if given)."""
    t0 = time.perf_counter()
    results = asyncio.run(closed_loop(url, prompts, max_tokens, concurrency, model))
    secs = time.perf_counter() - t0
    produced = sum(r["tokens"] for r in results)
    assert produced == sum(max_tokens), "the service did not produce every requested token"
    ttft = [r["chunks"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    chunks = sum(len(r["chunks"]) for r in results)
    # per request: (last chunk - first chunk) / (tokens - 1), however the tokens were grouped
    tpots = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"seconds": secs, "output_tokens": produced, "tokens_per_s": produced / secs,
            "requests_per_s": len(prompts) / secs, "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "tpot_s": percentiles(tpots), "tokens_per_chunk": produced / chunks}


def requests_for(concurrency: int, most: int) -> int:
    """Requests per run: enough to keep `concurrency` clients busy a while, 8 to `most`."""
    return min(most, max(8, 4 * concurrency))

