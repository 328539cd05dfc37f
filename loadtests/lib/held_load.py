"""Load held by one engine replica under HAProxy, and what it leaves behind: many streams sent
at once to a replica whose admission queues them, and a soak of closed-loop streaming clients
that disconnect at random; the replica process's RSS and open descriptors and the engine's
requests sampled meanwhile, and once the service is idle again (they must come back to their
baseline: no block, descriptor or request leaked).

loadtests/benchmarks/bench_held_load.py measures it for the docs; tests/e2e/test_held_load.py
checks the same, shorter, on a tiny model. The caller starts the service (a Ray Serve app
built from `service_args`) and passes the engine's stats.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

HTTP_PORT = 18420  # the service these runs start listens here (127.0.0.1 only)
CLEAN_REJECTIONS = (429, 503)


def replica_process() -> psutil.Process:
    """The engine replica's process (one replica: the first whose command line names it)."""
    for p in psutil.process_iter(["cmdline"]):
        if "EngineDeployment" in " ".join(p.info["cmdline"] or []):
            return p
    raise RuntimeError("no engine replica process is running")


def process_usage(proc: psutil.Process) -> dict[str, int]:
    return {"rss_bytes": proc.memory_info().rss, "open_fds": proc.num_fds()}


def tcp_connections(proc: psutil.Process) -> dict[str, int]:
    """The replica's TCP sockets by state (ESTABLISHED, CLOSE_WAIT, LISTEN...)."""
    return dict(Counter(c.status for c in proc.net_connections(kind="tcp")))


class Sampler:
    """Samples `proc`'s RSS and descriptors and `stats()` every `every_s` in a thread; keeps the peaks."""

    def __init__(self, proc: psutil.Process, stats: Callable[[], dict[str, Any]], every_s: float = 0.2) -> None:
        self.proc, self.stats, self.every_s = proc, stats, every_s
        self.peak = {"rss_bytes": 0, "open_fds": 0, "engine_requests": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            usage = process_usage(self.proc)
            s = self.stats()
            usage["engine_requests"] = s["num_running"] + s["num_waiting"]
            for k, v in usage.items():
                self.peak[k] = max(self.peak[k], v)
            self._stop.wait(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def idle(stats: dict[str, Any]) -> bool:
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def wait_idle(stats: Callable[[], dict[str, Any]], timeout_s: float = 60.0) -> dict[str, Any]:
    """The engine's stats once it holds no request and no block; raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats()
        if idle(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine was not idle {timeout_s:.0f} s after the load: {s}")
        time.sleep(0.2)


def settle(proc: psutil.Process, baseline_fds: int, timeout_s: float = 30.0) -> dict[str, int]:
    """The replica's usage once its descriptors are back to `baseline_fds` (sockets close a moment
    after their streams end), or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = process_usage(proc)
        if usage["open_fds"] <= baseline_fds or time.monotonic() > deadline:
            return usage
        time.sleep(0.2)


def _error_shape(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error.get("type"))


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], cut_after: int | None = None) -> dict[str, Any]:
    """One streamed request. `cut_after`: close the connection after that many chunks (0: as soon
    as the status line is in), as a client that goes away does."""
    sent = time.monotonic()
    out: dict[str, Any] = {"sent": sent, "status": None, "chunks": 0, "done": False, "error_event": False,
                           "first_chunk": None, "clean": False, "cut": False}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["clean"] = r.status_code in CLEAN_REJECTIONS and _error_shape(await r.aread())
            out["ended"] = time.monotonic()
            return out
        async for line in r.aiter_lines():
            if cut_after is not None and out["chunks"] >= cut_after:
                out["cut"] = True
                break  # leaving the block closes the connection before the stream's end
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error_event"] = True
            elif event.get("choices"):
                out["chunks"] += 1
                if out["first_chunk"] is None:
                    out["first_chunk"] = time.monotonic()
    out["ended"] = time.monotonic()
    return out


def _body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": f"held {i}", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}


async def _streams(url: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        return await asyncio.gather(*(_stream(client, _body(i, max_tokens)) for i in range(n)))


def held_streams(url: str, n: int, max_tokens: int, stats: Callable[[], dict[str, Any]],
                 gate: Path | None = None, gate_timeout_s: float = 300.0) -> dict[str, Any]:
    """`n` concurrent streams at once; what they got, and the replica's usage before, at its peak
    and after. With `gate` (a file the replica's engine computes nothing while it exists, as a
    test's engine wrapper does), the file is created first and removed once a sample shows the
    engine holding all `n` requests (or after `gate_timeout_s`): every stream is then held at
    once by construction, whatever the machine's load."""
    proc = replica_process()
    wait_idle(stats)
    before = process_usage(proc) | {"tcp": tcp_connections(proc)}
    t0 = time.monotonic()
    with Sampler(proc, stats) as sampler:
        opener = None
        if gate is not None:
            gate.touch()
            opener = threading.Thread(target=_open_when_held, args=(gate, sampler, n, gate_timeout_s), daemon=True)
            opener.start()
        results = asyncio.run(_streams(url, n, max_tokens))
        if opener is not None:
            opener.join()
    secs = time.monotonic() - t0
    after_stats = wait_idle(stats)
    after = settle(proc, before["open_fds"])
    after["tcp"] = tcp_connections(proc)
    statuses = Counter(str(r["status"]) for r in results)
    ok = [r for r in results if r["status"] == 200]
    last_sent, first_end = max(r["sent"] for r in results), min(r["ended"] for r in results)
    ttft = sorted(r["first_chunk"] - r["sent"] for r in ok if r["first_chunk"] is not None)
    return {"streams": n, "max_tokens": max_tokens, "seconds": secs, "statuses": dict(statuses),
            "complete": sum(r["done"] and r["chunks"] > 0 and not r["error_event"] for r in ok),
            "error_events": sum(r["error_event"] for r in ok),
            "unclean": sum(r["status"] != 200 and not r["clean"] for r in results),
            "all_sent_before_any_ended": last_sent < first_end,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None, "ttft_max_s": ttft[-1] if ttft else None,
            "before": before, "peak": sampler.peak, "after": after, "engine_after": after_stats}


def _open_when_held(gate: Path, sampler: Sampler, n: int, timeout_s: float) -> None:
    """Remove `gate` once the sampler has seen the engine hold `n` requests, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while sampler.peak["engine_requests"] < n and time.monotonic() < deadline:
        time.sleep(sampler.every_s)
    gate.unlink(missing_ok=True)


async def _soak(url: str, seconds: float, clients: int, max_tokens: int, disconnect: float,
                seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    # No cap on the pool: httpcore can lose a pool slot to a request cancelled while it waits for a
    # connection, and a 10-minute soak of random cancellations then ran out of slots (PoolTimeout
    # on the client's side); each worker has one request in flight at a time anyway.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=clients)
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=30), limits=limits) as client:
        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                body = _body(w * 1_000_000 + i, rng.randint(1, max_tokens))
                if rng.random() >= disconnect:
                    results.append(await _stream(client, body))
                elif rng.random() < 0.5:  # gone after a random number of chunks
                    results.append(await _stream(client, body, cut_after=rng.randrange(max_tokens)))
                else:  # gone within half a second, before or after the first byte
                    try:
                        results.append(await asyncio.wait_for(_stream(client, body), rng.uniform(0.0, 0.5)))
                    except asyncio.TimeoutError:
                        results.append({"status": None, "cut": True, "clean": True})

        await asyncio.gather(*(worker(w) for w in range(clients)))
    return results


def soak(url: str, seconds: float, clients: int, max_tokens: int, disconnect: float,
         stats: Callable[[], dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """`clients` closed-loop streaming clients for `seconds`, a `disconnect` share of requests cut
    at random; the statuses, and the engine and replica once it is all over."""
    proc = replica_process()
    wait_idle(stats)
    before = process_usage(proc) | {"tcp": tcp_connections(proc)}
    with Sampler(proc, stats) as sampler:
        results = asyncio.run(_soak(url, seconds, clients, max_tokens, disconnect, seed))
    after_stats = wait_idle(stats)
    after = settle(proc, before["open_fds"])
    after["tcp"] = tcp_connections(proc)
    ok = [r for r in results if r["status"] == 200]
    return {"seconds": seconds, "clients": clients, "disconnect": disconnect, "requests": len(results),
            "statuses": dict(Counter(str(r["status"]) if r["status"] else "cut before the status" for r in results)),
            "cut": sum(r["cut"] for r in results),
            "complete": sum(r["done"] and not r["error_event"] for r in ok if not r["cut"]),
            "uncut": sum(not r["cut"] for r in ok), "error_events": sum(r["error_event"] for r in ok),
            "unclean": sum(r["status"] != 200 and not r["clean"] for r in results),
            "before": before, "peak": sampler.peak, "after": after, "engine_after": after_stats}


def service_args(model_dir: str, streams: int) -> dict[str, Any]:
    """One replica that queues every stream (admission capacity: 64 slots + the queue)."""
    return {"model": model_dir, "accelerator": "cpu", "dtype": "float32", "max_num_seqs": 64,
            "max_queued_requests": streams, "engine_num_cpus": 1, "torch_threads": 1}

