"""Waiting on a condition: poll it, with a deadline far above the normal time (a hang bound,
never a guess of how long the wait takes, and never a sleep of a guessed length instead).
`wait_until` blocks; `wait_until_async` lets the event loop run between polls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.5) -> T:
    """Poll `probe` until it returns something other than None (or False); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last value: {last!r})")


async def wait_until_async(probe: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Poll `probe` until it returns something other than None (or False); fail after `timeout_s`.
    The loop runs between polls, so callbacks that make the condition true get their turn."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: T | None = None
    while loop.time() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        await asyncio.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last value: {last!r})")
