"""Locust scenarios for an OpenAI-compatible server (qkv-serve, vLLM, ...).

    locust -f loadtests/locustfile.py --headless -u 16 -r 16 -t 60s -H http://127.0.0.1:8000

Weighted scenarios (Locust tags in brackets, for `--tags` / `--exclude-tags`):
  chat short (stream)          4  [chat, stream]
  chat short                   2  [chat, nonstream]
  completion long (stream)     2  [completion, stream]
  completion long              1  [completion, nonstream]

Each user sends its next request as soon as the last one finished (closed loop), so `-u` is
the concurrency. Options (each also an environment variable): --model, --short-prompt-words,
--long-prompt-words, --short-max-tokens, --long-max-tokens, --ignore-eos, --api-key,
--request-timeout, --records-file (JSON lines, one per request, read by tools/load_report.py).

Locust entries: `POST <scenario>` is the whole request (end-to-end time; its "size" column
counts completion tokens from `usage`); `TTFT`, `ITL` (one sample per gap between streamed
tokens) and `E2E` are the latencies of successful requests. A request fails on a non-200
status, malformed SSE, an `error` event, a missing `[DONE]` or a missing `usage`.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import IO, Any

from locust import HttpUser, constant, events, tag, task
from locust.env import Environment

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtests.lib.openai_workload import (RequestResult, Scenario, StreamError, build_payload,  # noqa: E402
                                           make_prompt, read_json, read_stream)

logger = logging.getLogger(__name__)

_records: IO[str] | None = None


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    parser.add_argument("--model", env_var="QKV_MODEL", default="",
                        help="model field of each request (empty: the server's served model)")
    parser.add_argument("--short-prompt-words", type=int, env_var="QKV_SHORT_PROMPT_WORDS", default=12)
    parser.add_argument("--long-prompt-words", type=int, env_var="QKV_LONG_PROMPT_WORDS", default=100)
    parser.add_argument("--short-max-tokens", type=int, env_var="QKV_SHORT_MAX_TOKENS", default=32)
    parser.add_argument("--long-max-tokens", type=int, env_var="QKV_LONG_MAX_TOKENS", default=64)
    parser.add_argument("--ignore-eos", choices=["true", "false"], env_var="QKV_IGNORE_EOS", default="true",
                        help="send ignore_eos so every request generates exactly max_tokens")
    parser.add_argument("--api-key", env_var="OPENAI_API_KEY", default="", is_secret=True)
    parser.add_argument("--request-timeout", type=float, env_var="QKV_REQUEST_TIMEOUT", default=600.0)
    parser.add_argument("--records-file", env_var="QKV_RECORDS_FILE", default="",
                        help="append one JSON line per request here")
    parser.add_argument("--prompt-seed", type=int, env_var="QKV_PROMPT_SEED", default=0)


@events.test_start.add_listener
def _open_records(environment: Environment, **_: Any) -> None:
    global _records
    path = getattr(environment.parsed_options, "records_file", "")
    if path and _records is None:
        _records = open(path, "a", encoding="utf-8")


@events.test_stop.add_listener
def _close_records(**_: Any) -> None:
    global _records
    if _records is not None:
        _records.close()
        _records = None


def _fire(env: Environment, kind: str, name: str, seconds: float) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=seconds * 1000.0,
                            response_length=0, exception=None, context={})


class OpenAIUser(HttpUser):
    """One client sending the weighted scenarios back to back."""

    host = "http://127.0.0.1:8000"
    wait_time = constant(0)
    _user_count = 0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        OpenAIUser._user_count += 1
        self.rng = random.Random(opts.prompt_seed * 100_003 + OpenAIUser._user_count)
        self.model = opts.model or None
        self.ignore_eos = opts.ignore_eos == "true"
        self.timeout = opts.request_timeout
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        short, long_ = opts.short_prompt_words, opts.long_prompt_words
        self.scenarios = {
            "chat_stream": Scenario("chat short (stream)", "chat", short, opts.short_max_tokens, True),
            "chat": Scenario("chat short", "chat", short, opts.short_max_tokens, False),
            "completion_stream": Scenario("completion long (stream)", "completion", long_,
                                          opts.long_max_tokens, True),
            "completion": Scenario("completion long", "completion", long_, opts.long_max_tokens, False),
        }

    @tag("chat", "stream")
    @task(4)
    def chat_short_stream(self) -> None:
        self._send(self.scenarios["chat_stream"])

    @tag("chat", "nonstream")
    @task(2)
    def chat_short(self) -> None:
        self._send(self.scenarios["chat"])

    @tag("completion", "stream")
    @task(2)
    def completion_long_stream(self) -> None:
        self._send(self.scenarios["completion_stream"])

    @tag("completion", "nonstream")
    @task(1)
    def completion_long(self) -> None:
        self._send(self.scenarios["completion"])

    def _send(self, sc: Scenario) -> None:
        """Send one request of `sc`, judge it, report it to Locust and the records file."""
        body = build_payload(sc, make_prompt(self.rng, sc.prompt_words), self.model, self.ignore_eos)
        result = RequestResult(scenario=sc.name, stream=sc.stream, start=time.time())
        t0 = time.perf_counter()
        with self.client.post(sc.path, json=body, name=sc.name, headers=self.headers, stream=sc.stream,
                              timeout=self.timeout, catch_response=True) as resp:
            result.status = resp.status_code
            result.error = self._read(resp, sc, result, t0)
            result.e2e = time.perf_counter() - t0
            # Locust timed only up to the headers of a stream: report the whole request instead.
            resp.request_meta["response_time"] = result.e2e * 1000.0
            resp.request_meta["response_length"] = result.completion_tokens
            if result.error is None:
                resp.success()
            else:
                resp.failure(result.error)
        self._report(sc, result)

    def _read(self, resp: Any, sc: Scenario, result: RequestResult, t0: float) -> str | None:
        """Consume the response body; return why the request failed, or None."""
        if resp.status_code != 200:
            err = getattr(resp, "error", None)
            detail = str(err) if err is not None else (resp.text or "")[:300]
            return f"HTTP {resp.status_code}: {detail}"
        try:
            if sc.stream:
                read_stream(resp.iter_lines(), result, t0)
            else:
                read_json(resp.json(), result)
        except (StreamError, ValueError) as exc:
            return str(exc)
        except Exception as exc:  # a connection dropped mid-body is a failed request, not a crash
            return f"{type(exc).__name__}: {exc}"
        return None

    def _report(self, sc: Scenario, result: RequestResult) -> None:
        if result.ok:
            env = self.environment
            if result.ttft is not None:
                _fire(env, "TTFT", sc.name, result.ttft)
            for gap in result.itl:
                _fire(env, "ITL", sc.name, gap)
            _fire(env, "E2E", sc.name, result.e2e)
        if _records is not None:
            _records.write(json.dumps(result.to_record()) + "\n")
            _records.flush()
