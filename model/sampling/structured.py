"""Structured outputs: JSON schema, JSON object, regex, choice, EBNF grammar and structural-tag
constraints enforced while decoding, with xgrammar (the grammar engine vLLM and SGLang use).

A constraint (`StructuredSpec`) is compiled once per tokenizer and cached by its text; the
compile is thread-safe, so callers do it off the engine's step thread (`prepare`) and the
engine only looks it up. Each request then gets a `GrammarConstraint`: the allowed-token mask
of its next step (applied to its logits row by the sampler) and a state that advances with
every accepted token. The vocabulary is described to xgrammar by the raw bytes of each token
(`Tokenizer.id_to_bytes`), which fits the byte-level tokenizer and HF tokenizers alike.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from model.sampling.params import SamplingParams, StructuredSpec

logger = logging.getLogger(__name__)

# xgrammar (0.2.9) writes a length-limited JSON string (maxLength/minLength) as characters
# `[^"\\\r\n]`, which lets raw control characters through: strict JSON parsers reject those. Its
# string classes also take UTF-8-encoded surrogates (ED A0..BF xx) as one character, which decode
# as three U+FFFD (and break length limits). The classes are rewritten without both.
_STRING_CLASSES = {r'[^\"\\\r\n]': r'[^\"\\\0-\x1f\ud800-\udfff]',
                   r'[^\0-\x1f\"\\\r\n]': r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'}
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_REGEX_SPECIAL = frozenset("\\.^$*+?{}[]|()/")
# Compact JSON (", " and ": " separators, no free whitespace): a model cannot stall in a run
# of spaces and newlines.
_JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False}


def _xgr() -> Any:
    import xgrammar  # lazy: an engine that never sees a constraint does not load it

    return xgrammar


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in text)


def _enums_as_patterns(schema: Any) -> Any:
    """The schema with each string `enum`/`const` holding non-ASCII text rewritten as an
    anchored `pattern`: xgrammar 0.2.9 mis-matches such literals ("größer" accepts wrong
    bytes), its regexes do not. Same set of valid documents."""
    if isinstance(schema, list):
        return [_enums_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _enums_as_patterns(v) for k, v in schema.items()}
    values = out.get("enum") if "enum" in out else ([out["const"]] if "const" in out else None)
    # Only strings JSON writes as they are (no quote, backslash or control character).
    if (isinstance(values, list) and values and "pattern" not in out and all(isinstance(v, str) for v in values)
            and not all(v.isascii() for v in values)
            and not any(ch in '"\\' or ord(ch) < 0x20 for v in values for ch in v)):
        for key in ("enum", "const", "type"):
            out.pop(key, None)
        out.update(type="string", pattern="^(" + "|".join(_regex_literal(v) for v in values) + ")$")
    return out


def _clean(exc: Exception) -> str:
    """xgrammar's error text without its timestamp and C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _ERROR_PREFIX.sub("", text)


def _fixed(grammar: Any) -> Any:
    """`grammar` with its JSON strings unable to hold control characters or surrogates."""
    text = str(grammar)
    if not any(lax in text for lax in _STRING_CLASSES):
        return grammar
    for lax, strict in _STRING_CLASSES.items():
        text = text.replace(lax, strict)
    return _xgr().Grammar.from_ebnf(text)


@lru_cache(maxsize=512)
def _schema_ebnf(text: str) -> str:
    schema = _enums_as_patterns(json.loads(text))
    return str(_fixed(_xgr().Grammar.from_json_schema(json.dumps(schema), **_JSON_OPTIONS)))


def json_schema_ebnf(schema: dict[str, Any]) -> str:
    """The EBNF (root rule `root`) of compact JSON valid against `schema`, as the `json` kind
    constrains it: what a structural tag embeds for a tool's arguments."""
    return _schema_ebnf(json.dumps(schema))


@lru_cache(maxsize=512)
def build_grammar(spec: StructuredSpec) -> Any:
    """The tokenizer-independent `xgrammar.Grammar` of `spec`; ValueError naming the field
    when the schema, regex, choice list or grammar is invalid. Cheap: the HTTP edge calls it
    to answer 400 before anything is queued."""
    xgr = _xgr()
    field = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object", "structural_tag": "structural_tag"}[spec.kind]
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_ebnf(_schema_ebnf(spec.text))
        if spec.kind == "structural_tag":
            return _fixed(xgr.Grammar.from_structural_tag(spec.text))
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **_JSON_OPTIONS)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            # A regex, not EBNF literals: xgrammar 0.2.9 mis-matches EBNF literals with non-ASCII
            # characters in alternatives ("größer" | "x"), its regexes do not.
            return xgr.Grammar.from_regex("(" + "|".join(_regex_literal(c) for c in json.loads(spec.text)) + ")")
        return xgr.Grammar.from_ebnf(spec.text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field} is not valid JSON: {exc}") from None
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse and conversion errors
        raise ValueError(f"invalid {field}: {_clean(exc)}") from None


def check_structured(params: SamplingParams) -> None:
    """Raise ValueError when `params` carries a constraint that does not compile."""
    spec = params.structured
    if spec is not None:
        build_grammar(spec)


class GrammarConstraint:
    """One request's place in its grammar: a logits processor for the sampler (masks every
    token the grammar does not allow next) that advances with each accepted token."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = _xgr()
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # (1, ceil(V / 32)) int32 on CPU
        self._vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor) -> None:
        """Set the logits (V,) of every token the grammar forbids next to -inf, in place."""
        if not self._matcher.fill_next_token_bitmask(self._bitmask):
            return  # every token is allowed
        if logits.device.type == "cpu":
            # Bit i of the little-endian int32 word j is token 32j + i. numpy's unpackbits is
            # ~5x faster than xgrammar's CPU kernel (0.04 vs 0.23 ms for 32k tokens).
            allowed = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[: logits.shape[0]]
            logits.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))
        else:
            # CUDA: xgrammar's Triton kernel. Elsewhere plain torch ops, not xgrammar's default there
            # (torch.compile): on the meta device its recompiles failed inside Inductor once another
            # test had compiled it for other shapes (a random-order run of the suite).
            self._xgr.apply_token_bitmask_inplace(logits.view(1, -1), self._bitmask.to(logits.device),
                                                  vocab_size=self._vocab_size,
                                                  backend="auto" if logits.device.type == "cuda" else "torch_native")

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it (nothing changes)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The structure is complete and its end (a stop token) was accepted."""
        return bool(self._matcher.is_terminated())


class StructuredOutputs:
    """Compiles constraints for one tokenizer and hands out per-request `GrammarConstraint`s.

    Thread-safe: `prepare` may run on any thread (the service compiles on a worker thread so a
    slow compile never stalls the running batch); compiled grammars are cached by their text.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(set(stop_token_ids))
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiled: dict[StructuredSpec, Any] = {}

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                vocab = [self._tokenizer.id_to_bytes(i) for i in range(self._tokenizer.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self._vocab_size,
                                         stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compiled(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of `spec` (cached by its text); ValueError when invalid."""
        with self._lock:
            hit = self._compiled.get(spec)
        if hit is not None:
            return hit
        if not self._stop_ids:
            raise ValueError("structured outputs need a tokenizer with an end-of-sequence token")
        grammar = build_grammar(spec)
        compiled = self._get_compiler().compile_grammar(grammar)
        with self._lock:
            return self._compiled.setdefault(spec, compiled)

    def prepare(self, params: list[SamplingParams]) -> None:
        """Compile (or find cached) every constraint in `params`, so that `constraint` is a
        lookup. Raises ValueError for an invalid one."""
        for p in params:
            if p.structured is not None:
                self.compiled(p.structured)

    def constraint(self, params: SamplingParams) -> GrammarConstraint | None:
        """A fresh matcher for a new request, or None when it has no constraint."""
        spec = params.structured
        if spec is None:
            return None
        return GrammarConstraint(self.compiled(spec), self._vocab_size)
