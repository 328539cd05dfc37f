"""Generated token ids -> streamed text, with stop strings, one per request."""

from __future__ import annotations

import codecs

from model.loading.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for streaming.

    Bytes go through an incremental UTF-8 decoder, so a character split over tokens is
    emitted once, whole (an impossible byte sequence comes out as U+FFFD at once). Stop
    strings are searched across token boundaries; the text returned stops before the first
    one found. With `hold_back_for_stop`, text that may be the start of a stop string is
    held until the next tokens show whether it is; without it, such text is emitted and a
    stop string's beginning may already have gone out when it completes.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, hold_back_for_stop: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stops = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._hold_back = hold_back_for_stop
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded but not yet emitted
        self._tail = ""  # last emitted characters a stop string could start in
        self._pieces: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be "")."""
        if self.stopped:
            return ""
        return self._advance(self._utf8.decode(self._tokenizer.id_to_bytes(token_id)), final=False)

    def flush(self) -> str:
        """Generation ended without a stop string: return everything still held back
        (an unfinished character becomes U+FFFD)."""
        if self.stopped:
            return ""
        return self._advance(self._utf8.decode(b"", final=True), final=True)

    def _advance(self, new: str, final: bool) -> str:
        self._pending += new
        if self._stops and self._find_stop():
            out, self._pending = self._pending, ""
            return self._emit(out)
        keep = 0 if final or not self._hold_back else self._stop_prefix_len(self._pending)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return self._emit(out)

    def _find_stop(self) -> bool:
        """Cut `_pending` before the earliest complete stop string, if any."""
        window = self._tail + self._pending
        hits = [(i, s) for s in self._stops if (i := window.find(s)) >= 0]
        if not hits:
            return False
        start, stop = min(hits, key=lambda h: h[0])
        self._pending = self._pending[: max(start - len(self._tail), 0)]
        self.stopped = True
        self.stop_reason = stop
        return True

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self._stops):
                return k
        return 0

    def _emit(self, out: str) -> str:
        if out:
            self._pieces.append(out)
            if self._max_stop > 1:
                self._tail = (self._tail + out)[-(self._max_stop - 1) :]
        return out
