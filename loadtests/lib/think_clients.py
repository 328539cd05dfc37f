"""Closed-loop streaming clients with a think time, through httpx, each under an API key (or none):
what the benchmarks of one service's traffic mixes drive (tenants beside a flood, interactive
requests beside a batch). A client sends a streamed `/v1/completions` of random words, reads it
to its end, waits its think time (or a 429's retry-after-ms or Retry-After, as the official SDKs do), and goes on
until the clock runs out; each result is its status, TTFT (to the first text chunk) and the wall
clock time it was sent."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx

WORDS = ("red", "blue", "cat", "sat", "on", "the", "mat")
# One client: (API key or None, max_tokens, think time in seconds, the seed of its prompts' words).
Work = tuple[str | None, int, float, int]


def retry_after(headers: httpx.Headers) -> float:
    """The wait a refusal asks for, read as the official OpenAI and Anthropic SDKs read it:
    `retry-after-ms` first, then `Retry-After` in seconds (1 s without either)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            return float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
    return 1.0


async def stream_once(http: httpx.AsyncClient, key: str | None, prompt: str, max_tokens: int,
                      model: str = "bench") -> dict[str, Any]:
    """One streaming completion: its status, TTFT (to the first text chunk), when it was sent, and
    the wait a refusal asks for."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    sent, t0 = time.time(), time.perf_counter()  # wall clock: comparable between the clients' processes
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": retry_after(r.headers), "sent": sent}
        ttft, ok = None, False
        async for line in r.aiter_lines():
            if line.startswith("data: ") and ttft is None and '"text"' in line:
                ttft = time.perf_counter() - t0
            ok = ok or line == "data: [DONE]"
        return {"status": 200 if ok else -1, "ttft": ttft, "sent": sent}


async def client_loop(http: httpx.AsyncClient, work: Work, until: float, out: list[dict[str, Any]],
                      words: tuple[str, ...] = WORDS) -> None:
    key, max_tokens, think_s, seed = work
    rng = random.Random(seed)
    while time.perf_counter() < until:
        prompt = " ".join(rng.choice(words) for _ in range(24))
        try:
            res = await stream_once(http, key, prompt, max_tokens)
        except httpx.HTTPError as exc:
            res = {"status": -2, "error": type(exc).__name__}
        out.append(res)
        await asyncio.sleep(res.get("retry_after", think_s) if res["status"] == 429 else think_s)


async def clients(url: str, work: list[Work], seconds: float, ready: Any = None,
                  words: tuple[str, ...] = WORDS) -> list[list[dict[str, Any]]]:
    """Closed-loop clients, one per `Work`, for `seconds`; each client's connection is made before
    the clock starts (an httpx client costs milliseconds to create). `ready` (an event) is set then."""
    outs: list[list[dict[str, Any]]] = [[] for _ in work]
    https = [httpx.AsyncClient(base_url=url, timeout=300) for _ in work]
    if ready is not None:
        ready.set()
    until = time.perf_counter() + seconds
    try:
        await asyncio.gather(*(client_loop(http, w, until, out, words) for http, w, out in zip(https, work, outs)))
    finally:
        for http in https:
            await http.aclose()
    return outs


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests, their statuses, the share answered 200, and the TTFT p50/p99 (ms) of those answered."""
    ttfts = sorted(r["ttft"] for r in results if r["status"] == 200 and r.get("ttft") is not None)
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {"requests": len(results), "statuses": statuses,
            "success": statuses.get("200", 0) / len(results) if results else 0.0,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else None,
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None}
