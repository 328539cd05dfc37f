"""Speculative decoding inside the continuous-batching engine (issue 27).

`model/config/speculative.py` parses `speculative_config`; `ngram.py` (prompt lookup) and `draft.py` (a small model
with its own paged cache and runner) propose tokens; the engine verifies them in its own step, a
speculating sequence scheduled as a chunk of 1 + k positions over its cached past
(`ScheduledSeq.spec`); `decoder.py` turns the target's logits at those positions into the tokens
kept, by `rejection.py`'s rule, and `Scheduler.verified` rolls the rejected K/V back.
"""

from model.engine.spec_decode.decoder import SpecDecoder, SpecStats

__all__ = ["SpecDecoder", "SpecStats"]
