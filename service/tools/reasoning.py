"""Reasoning output: the text a thinking model writes inside `<think>...</think>` (Qwen3,
DeepSeek-R1 and its distills), split from the answer as it streams.

Whether an answer starts inside the thinking is read from the rendered prompt: DeepSeek-R1
templates end the generation prompt with an open `<think>`; Qwen3 leaves it to the model to open
one, and writes an empty, closed one when `enable_thinking` is false (no reasoning then).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSER_CHOICES = ("auto", "none", "qwen3", "deepseek_r1")
MARKER_TOKENS = (THINK_OPEN, THINK_CLOSE)


def template_thinks(template: str | None) -> bool:
    """A chat template of a thinking model (it writes or strips `</think>`)."""
    return bool(template) and THINK_CLOSE in template


def resolve_reasoning(choice: str, template: str | None) -> bool:
    """`reasoning_parser` -> whether answers are split into reasoning and content."""
    if choice not in PARSER_CHOICES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSER_CHOICES)}, got {choice!r}")
    return template_thinks(template) if choice == "auto" else choice != "none"


@dataclass(frozen=True)
class ReasoningMode:
    """How one answer may think: it starts inside the thinking, or it may open it first."""

    starts_inside: bool
    may_open: bool

    @staticmethod
    def of_prompt(prompt: str) -> "ReasoningMode":
        if prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE):
            return ReasoningMode(True, False)
        # The prompt already closed the thinking (Qwen3 with enable_thinking false).
        return ReasoningMode(False, not prompt.rstrip().endswith(THINK_CLOSE))

    @property
    def thinks(self) -> bool:
        return self.starts_inside or self.may_open

    def grammar_prefix(self) -> dict[str, Any] | None:
        """The structural-tag element of the thinking before the answer's constraint (free text
        up to `</think>`, where no trigger opens a call), or None."""
        thinking = {"type": "any_text"}
        if self.starts_inside:
            return {"type": "tag", "begin": "", "content": thinking, "end": THINK_CLOSE}
        if self.may_open:
            return {"type": "optional", "content": {"type": "tag", "begin": THINK_OPEN, "content": thinking,
                                                     "end": THINK_CLOSE}}
        return None


class ReasoningSplitter:
    """Text chunks in, ("reasoning" | "content", text) pieces out, for one answer. The tags are
    dropped, and so are the newlines right after `</think>`. `reasoning_chars` is where the
    reasoning ended in the whole output text (its tokens are counted from it)."""

    def __init__(self, mode: ReasoningMode) -> None:
        self._state = "inside" if mode.starts_inside else ("start" if mode.may_open else "content")
        self._buf = ""
        self._consumed = 0  # characters of output read before `_buf`
        self.reasoning_chars = 0

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf or final:
            before = self._state
            piece = self._step(final)
            if piece:
                if out and out[-1][0] == piece[0]:
                    out[-1] = (piece[0], out[-1][1] + piece[1])
                else:
                    out.append(piece)
            if self._state == before and not piece:
                break
        return out

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._consumed += len(taken)
        return taken

    def _step(self, final: bool) -> tuple[str, str] | None:
        if self._state == "start":
            stripped = self._buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._take(len(self._buf) - len(stripped) + len(THINK_OPEN))
                self._state = "inside"
                self.reasoning_chars = self._consumed
            elif final or not THINK_OPEN.startswith(stripped):
                self._state = "content"
            return None
        if self._state == "inside":
            k = self._buf.find(THINK_CLOSE)
            if k >= 0:
                reasoning = self._take(k)
                self._take(len(THINK_CLOSE))
                self._state = "after"
                self.reasoning_chars = self._consumed
                return ("reasoning", reasoning) if reasoning else None
            keep = 0 if final else _overlap(self._buf, THINK_CLOSE)
            reasoning = self._take(len(self._buf) - keep)
            self.reasoning_chars = self._consumed
            if final:
                self._state = "content"
            return ("reasoning", reasoning) if reasoning else None
        if self._state == "after":
            stripped = self._buf.lstrip("\n")
            self._take(len(self._buf) - len(stripped))
            if stripped or final:
                self._state = "content"
            return None
        content = self._take(len(self._buf))
        return ("content", content) if content else None


def _overlap(text: str, tag: str) -> int:
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def count_reasoning_tokens(token_ids: list[int], reasoning_chars: int, tokenizer: Any) -> int:
    """How many of an answer's tokens wrote its first `reasoning_chars` characters (the
    thinking and its tags), decoding them as the detokenizer does (bytes that are not UTF-8
    become one U+FFFD each)."""
    if reasoning_chars <= 0:
        return 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    written = 0
    for n, token_id in enumerate(token_ids, 1):
        written += len(decoder.decode(tokenizer.id_to_bytes(token_id)))
        if written >= reasoning_chars:
            return n
    return len(token_ids)
