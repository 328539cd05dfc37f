"""The API's error shape and the headers of a refusal (service/errors.py)."""

from __future__ import annotations

import pytest

from service.errors import overloaded_error, retry_after_headers


@pytest.mark.parametrize("wait_s, seconds, spread_s", [(1.0, "1", 1.0), (0.2, "1", 0.2), (0.0, "1", 0.1),
                                                       (37.2, "38", 1.0)])
def test_a_refusal_says_when_to_come_back_in_seconds_and_in_jittered_milliseconds(
        wait_s: float, seconds: str, spread_s: float) -> None:
    headers = [retry_after_headers(wait_s) for _ in range(200)]
    assert {h["Retry-After"] for h in headers} == {seconds}
    waits = [int(h["retry-after-ms"]) / 1e3 for h in headers]
    # Never before the wait the server asked for, never more than `spread_s` after it...
    assert all(max(wait_s, 0.001) - 1e-3 <= w <= wait_s + spread_s + 1e-3 for w in waits), waits
    # ...and spread over that range, so that clients refused together do not come back together.
    assert max(waits) - min(waits) > spread_s / 2, waits


def test_an_overloaded_answer_carries_both_headers() -> None:
    err = overloaded_error(503, 2.5)
    assert err.status == 503 and err.headers["Retry-After"] == "3"
    assert 2500 <= int(err.headers["retry-after-ms"]) <= 3500
