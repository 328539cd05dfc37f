"""The OpenAI-compatible workload the Locust users send, without Locust.

Prompts are generated locally from a fixed word list and a seeded RNG, payloads follow the
OpenAI `/v1/completions` and `/v1/chat/completions` bodies, and `read_stream` turns an SSE
response into one `RequestResult` (TTFT, inter-token gaps, end-to-end latency, token counts
from `usage`) or a failure reason. loadtests/locustfile.py wires this into Locust;
loadtests/lib/load_summary.py reads the JSON lines that `RequestResult.to_record` produces.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

# Plain lowercase words: ASCII, so that a byte-level tokenizer counts ~6 tokens per word
# and a BPE tokenizer ~1.3.
WORDS = (
    "the attention model learns which tokens matter for the next one and a decoder layer "
    "stacks masked self attention with a position wise feed forward network each head projects "
    "queries keys and values into a smaller space so many heads cost about as much as one "
    "residual connections and layer normalization keep deep stacks trainable while sinusoidal "
    "positions tell the model where each token sits in the sequence during generation the cache "
    "keeps keys and values of earlier tokens so every step only computes the newest position"
).split()


class StreamError(Exception):
    """A streamed response broke the protocol (malformed SSE, error event, missing [DONE])."""


@dataclass
class Scenario:
    """One kind of request: which route, how long a prompt, how many tokens, streamed or not."""

    name: str
    route: str  # "chat" or "completion"
    prompt_words: int
    max_tokens: int
    stream: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"


@dataclass
class RequestResult:
    """What one request measured, in seconds; `error` is None when it succeeded."""

    scenario: str
    stream: bool
    start: float
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); None if not measurable."""
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def to_record(self) -> dict[str, Any]:
        """A JSON-serialisable dict, one line of the records file."""
        rec = asdict(self)
        rec["itl"] = [round(x, 6) for x in self.itl]
        rec["tpot"] = self.tpot
        return rec


def make_prompt(rng: random.Random, n_words: int) -> str:
    """`n_words` words drawn from WORDS (at least one)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


def build_payload(
    scenario: Scenario, prompt: str, model: str | None, ignore_eos: bool
) -> dict[str, Any]:
    """The JSON body for `scenario`. Without `model` the service picks its served model."""
    body: dict[str, Any] = {"max_tokens": scenario.max_tokens, "temperature": 0.0}
    if scenario.route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension: fixed output lengths, like `vllm bench`
    if scenario.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _chunk_has_token(chunk: dict[str, Any]) -> bool:
    """True when an SSE chunk carries generated output (text, delta content or finish)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            return True
    return False


def read_stream(lines: Iterable[bytes | str], result: RequestResult, t0: float) -> None:
    """Consume SSE `lines`, filling `result`'s timings and usage; raise StreamError on a fault.

    `t0` is the `time.perf_counter()` at which the request was sent. Blank lines and SSE
    comments (`:`) are allowed; every other line must be `data: <json>` or `data: [DONE]`.
    """
    last: float | None = None
    done = False
    usage: dict[str, Any] | None = None
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line or line.startswith(":"):
            continue
        if done:
            raise StreamError(f"data after [DONE]: {line[:80]!r}")
        if not line.startswith("data:"):
            raise StreamError(f"malformed SSE line: {line[:80]!r}")
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise StreamError(f"malformed SSE JSON: {data[:80]!r}") from exc
        if not isinstance(chunk, dict):
            raise StreamError(f"SSE chunk is not an object: {data[:80]!r}")
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])[:200]}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        if _chunk_has_token(chunk):
            now = time.perf_counter()
            if last is None:
                result.ttft = now - t0
            else:
                result.itl.append(now - last)
            last = now
    if not done:
        raise StreamError("stream ended without data: [DONE]")
    if usage is None:
        raise StreamError("stream carried no usage chunk (stream_options.include_usage)")
    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    result.completion_tokens = int(usage.get("completion_tokens", 0))


def read_json(body: Any, result: RequestResult) -> None:
    """Fill token counts from a non-streamed response body; raise ValueError if malformed."""
    if not isinstance(body, dict) or not body.get("choices"):
        raise ValueError("response has no choices")
    usage = body.get("usage")
    if not isinstance(usage, dict):
        raise ValueError("response has no usage")
    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    result.completion_tokens = int(usage.get("completion_tokens", 0))
