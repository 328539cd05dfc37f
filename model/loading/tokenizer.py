"""Tokenizers (byte-level by default, any HF `tokenizer.json`) and streaming detokenization.

Everything here works on the bytes a token stands for, so a character split over
several tokens is decoded once, whole, when its last byte arrives. No torch.
"""

from __future__ import annotations

import json
import logging
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from model.config import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE
from model.loading.generation_config import load_generation_config

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the HTTP edge need from a tokenizer.

    The tokenizer is the one source of a model's special tokens: `eos_token_ids` are all the
    ids that end generation (the tokenizer's own EOS first, then those of the checkpoint's
    generation config), `eos_token_id` is the first of them; `bos_token` / `eos_token` are
    the strings chat templates see (None when the tokenizer has none).
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` runs the tokenizer's post-processor
        (e.g. Llama 3's BOS), as `transformers` does."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def id_to_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for; b"" for special tokens."""
        ...


def _check_id(token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is out of range: allowed 0..{vocab_size - 1}")


def _eos_ids(own: int | None, extra: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The tokenizer's EOS then the generation config's, without repeats; ids outside the
    vocabulary are dropped (with a warning): they could never be generated."""
    ids = []
    for i in dict.fromkeys(([] if own is None else [own]) + list(extra)):
        if 0 <= i < vocab_size:
            ids.append(i)
        else:
            logger.warning("eos_token_id %d is outside the vocabulary (%d tokens): ignored", i, vocab_size)
    return tuple(ids)


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes, 256 is `<eos>`, 257 is `<pad>`; larger ids (padding of a
    bigger embedding) stand for nothing. `<eos>` has no text form: templates see no eos_token."""

    pad_token_id: int = BYTE_PAD_ID
    bos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    def __init__(self, vocab_size: int = BYTE_VOCAB_SIZE, extra_eos_ids: tuple[int, ...] = ()) -> None:
        """`extra_eos_ids`: more ids that end generation (a checkpoint's generation config)."""
        if vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(
                f"tokenizer vocabulary ({BYTE_VOCAB_SIZE}) is larger than the model's embedding ({vocab_size})"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = _eos_ids(BYTE_EOS_ID, extra_eos_ids, vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.id_to_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        _check_id(token_id, self.vocab_size)
        return bytes((token_id,)) if token_id < 256 else b""


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the others
    (controls, space, ...) to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _decoder_types(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Flatten a tokenizer.json decoder (possibly a Sequence) into its parts."""
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [part for d in decoder.get("decoders", []) for part in _decoder_types(d)]
    return [decoder]


class HFTokenizer:
    """A `tokenizer.json` through the `tokenizers` library, with the special tokens and chat
    template of `tokenizer_config.json` (or `special_tokens_map.json`) and the EOS ids of the
    generation config (`generation_config.json`, else `config.json`) in the same directory."""

    def __init__(self, path: str | Path, model_vocab_size: int | None = None) -> None:
        """`model_vocab_size`: the model's embedding size when it is padded beyond the
        tokenizer's vocabulary; those extra ids decode to nothing."""
        from tokenizers import Tokenizer as _RustTokenizer  # lazy: only HF checkpoints need it

        directory = Path(path)
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        self._tok = _RustTokenizer.from_file(str(file))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids, not the entry count, bound the embedding: added tokens may leave gaps.
        self.vocab_size = max(vocab.values()) + 1
        tok_config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        self.bos_token = _special_token(tok_config, special_map, "bos_token")
        self.eos_token = _special_token(tok_config, special_map, "eos_token")
        generation = load_generation_config(directory)
        self.bos_token_id = self._token_id(self.bos_token)
        if self.bos_token_id is None:
            self.bos_token_id = generation.bos_token_id
        self.eos_token_ids = _eos_ids(self._token_id(self.eos_token), generation.eos_token_ids,
                                      max(self.vocab_size, model_vocab_size or 0))
        self.chat_template = _find_chat_template(directory, tok_config)
        self._id_bytes = self._build_id_bytes(vocab, json.loads(file.read_text("utf-8")).get("decoder"))
        self._num_real_ids = self.vocab_size
        if model_vocab_size is not None and model_vocab_size > self.vocab_size:
            self._id_bytes += [b""] * (model_vocab_size - self.vocab_size)
            self.vocab_size = model_vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        for i in ids:
            _check_id(i, self.vocab_size)
        real = [i for i in ids if i < self._num_real_ids]  # padding ids of the embedding decode to nothing
        return self._tok.decode(real, skip_special_tokens=True)

    def id_to_bytes(self, token_id: int) -> bytes:
        _check_id(token_id, self.vocab_size)
        return self._id_bytes[token_id]

    def reveal_special_tokens(self, tokens: list[str]) -> list[str]:
        """Let these special tokens stream as their text (they decode to nothing otherwise):
        a tool-call format that writes one, such as Mistral's `[TOOL_CALLS]`, is parsed from
        the text. Returns the tokens that changed. Call before the first request."""
        revealed = []
        for token in tokens:
            i = self._tok.token_to_id(token)
            if i is not None and i < len(self._id_bytes) and not self._id_bytes[i]:
                self._id_bytes[i] = token.encode("utf-8")
                revealed.append(token)
        return revealed

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _build_id_bytes(self, vocab: dict[str, int], decoder: dict[str, Any] | None) -> list[bytes]:
        """Precompute every token's bytes so streaming never asks the tokenizer again."""
        kinds = {d.get("type") for d in _decoder_types(decoder)}
        specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        added = set(self._tok.get_added_tokens_decoder())
        sentencepiece = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in _decoder_types(decoder)
        )
        if not ("ByteLevel" in kinds or sentencepiece):
            logger.info("tokenizer decoder %s: token bytes come from decoding tokens one by one", sorted(kinds))
        table = [b""] * self.vocab_size
        to_byte = _unicode_to_byte()
        for piece, i in vocab.items():
            if i in specials:
                continue
            if i in added:  # added tokens are emitted verbatim by every decoder
                table[i] = piece.encode("utf-8")
            elif "ByteLevel" in kinds and all(c in to_byte for c in piece):
                table[i] = bytes(to_byte[c] for c in piece)
            elif sentencepiece:
                match = _BYTE_FALLBACK.match(piece) if "ByteFallback" in kinds else None
                table[i] = bytes((int(match.group(1), 16),)) if match else piece.replace("▁", " ").encode("utf-8")
            else:
                table[i] = self._tok.decode([i], skip_special_tokens=False).encode("utf-8")
        return table


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    data = json.loads(file.read_text("utf-8"))
    return data if isinstance(data, dict) else {}


def _special_token(tok_config: dict[str, Any], special_map: dict[str, Any], name: str) -> str | None:
    """A special token's string (`"</s>"` or `{"content": "</s>", ...}`), as transformers reads it."""
    for source in (tok_config, special_map):
        token = source.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def _find_chat_template(directory: Path, tok_config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's "chat_template" (a string, or a list of named templates), else
    the separate `chat_template.jinja` that newer transformers versions write, else the
    `chat_template.json` a vision model's processor saves (llava-hf's only template)."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str):
        return template
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text("utf-8")
    processor = directory / "chat_template.json"
    if processor.is_file():
        template = json.loads(processor.read_text("utf-8")).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_tokenizer(model_dir: str | Path | None, vocab_size: int) -> Tokenizer:
    """The checkpoint's `tokenizer.json` when there is one, else the byte tokenizer; either
    way with the EOS ids of the checkpoint's generation config.

    `vocab_size` is the model's embedding size; a tokenizer that can produce ids beyond it
    is refused.
    """
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        tokenizer: Tokenizer = HFTokenizer(model_dir, model_vocab_size=vocab_size)
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's embedding ({vocab_size})"
            )
        return tokenizer
    return ByteTokenizer(vocab_size, load_generation_config(model_dir).eos_token_ids)
