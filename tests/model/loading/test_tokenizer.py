"""Tokenizers and streaming detokenization: UTF-8 safety and stop strings across tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.config import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE
from model.engine.detokenizer import IncrementalDetokenizer
from model.loading.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from tests.support.requirements import need_module

TEXTS = ["Hello, world!", "你好，世界", "👍🏽 and 🎉", "mixed: café 日本語 🇯🇵 done"]
SENTENCES = [
    "The cat sat on the mat.",
    "Attention is all you need.",
    "你好，世界！今天天气很好。",
    "Emoji time: 👍🏽 and 🎉 and 🚀",
    "the quick brown fox jumps over the lazy dog",
] * 4


def stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Push ids one at a time; return every returned piece (flush last unless stopped)."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        if detok.stopped:
            break
    else:
        pieces.append(detok.flush())
    return pieces, detok


def assert_whole_characters(pieces: list[str]) -> None:
    for piece in pieces:
        assert "\ufffd" not in piece, f"broken character in {piece!r}"
        assert piece.encode("utf-8").decode("utf-8") == piece


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert b"".join(tok.id_to_bytes(i) for i in ids) == text.encode("utf-8")


def test_byte_special_tokens() -> None:
    tok = ByteTokenizer(vocab_size=300)
    assert tok.vocab_size == 300 and tok.eos_token_id == BYTE_EOS_ID and tok.chat_template is None
    assert tok.decode([104, 105, BYTE_EOS_ID, BYTE_PAD_ID, 299]) == "hi"
    assert tok.id_to_bytes(BYTE_EOS_ID) == b"" and tok.id_to_bytes(299) == b""
    assert tok.decode([0xE4, 0xBD]) == "\ufffd"  # a truncated character is replaced, not raised
    with pytest.raises(ValueError, match="300"):
        tok.id_to_bytes(300)
    with pytest.raises(ValueError, match=r"tokenizer vocabulary \(258\) is larger than the model's embedding \(100\)"):
        ByteTokenizer(vocab_size=100)


@pytest.mark.parametrize("text", ["你好，世界", "👍🏽 and 🎉", "a🇯🇵b"])
def test_incremental_never_breaks_characters(text: str) -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode(text))
    assert "".join(pieces) == text == detok.text
    assert_whole_characters(pieces)
    # Each character comes out exactly when its last byte arrives.
    assert [p for p in pieces if p] == list(text)
    assert not detok.stopped and detok.stop_reason is None


def test_invalid_bytes_are_not_held_forever() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(0xE4) == ""  # a valid start: wait for more
    assert detok.push(0x41) == "\ufffdA"  # it can never complete: replaced at once
    assert detok.push(0xFF) == "\ufffd"  # never valid in UTF-8
    assert detok.push(0xF0) + detok.push(0x9F) + detok.push(0x8E) == ""
    assert detok.flush() == "\ufffd"  # generation ended mid-character
    assert detok.text == "\ufffdA\ufffd\ufffd"


def test_stop_string_across_tokens() -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode("hello world and more"), stop=["world"])
    assert "".join(pieces) == "hello " == detok.text
    assert detok.stopped and detok.stop_reason == "world"
    # "w", "o", ... were held back: nothing of the stop string was ever returned.
    assert all("w" not in p for p in pieces)
    assert detok.push(tok.encode("x")[0]) == "" and detok.flush() == ""


def test_false_start_of_stop_string_is_released() -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode("wow, a world"), stop=["world"])
    assert "".join(pieces) == "wow, a "
    assert detok.stop_reason == "world"
    # "wo" was held until the second "w" showed it was not "world"; that "w" is held in turn.
    assert pieces[:4] == ["", "", "wo", "w,"]


def test_earliest_stop_string_wins() -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode("one two three"), stop=["three", "two"])
    assert "".join(pieces) == "one " and detok.stop_reason == "two"
    # Both complete on the same token: the one that starts first cuts the text.
    pieces, detok = stream(tok, tok.encode("xabcd"), stop=["bc", "abc"])
    assert "".join(pieces) == "x" and detok.stop_reason == "abc"


def test_multibyte_stop_string() -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode("你好，世界"), stop=["世"])
    assert "".join(pieces) == "你好，" and detok.stop_reason == "世"
    assert_whole_characters(pieces)
    pieces, detok = stream(tok, tok.encode("ok 🎉 done"), stop=["🎉"])
    assert "".join(pieces) == "ok " and detok.stop_reason == "🎉"


def test_no_stop_flush_returns_held_back_text() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, stop=["world"])
    out = "".join(detok.push(i) for i in tok.encode("hello wor"))
    assert out == "hello " and detok.text == "hello "
    assert detok.flush() == "wor"
    assert detok.text == "hello wor" and not detok.stopped and detok.stop_reason is None


def test_without_hold_back_text_streams_at_once() -> None:
    tok = ByteTokenizer()
    pieces, detok = stream(tok, tok.encode("ab cd"), stop=["cd"], hold_back_for_stop=False)
    assert pieces == ["a", "b", " ", "c", ""]
    assert detok.stopped and detok.stop_reason == "cd"


# --- a real byte-level BPE tokenizer.json, trained here ------------------------------------


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(SENTENCES, trainer)
    directory = tmp_path_factory.mktemp("bpe")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({
            "eos_token": {"content": "<|endoftext|>"},
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            "tokenizer_class": "GPT2Tokenizer",
        })
    )
    return directory


def test_hf_byte_level_round_trip(bpe_dir: Path) -> None:
    tok = HFTokenizer(bpe_dir)
    assert isinstance(tok, Tokenizer)
    assert tok.eos_token_id == 0 and tok.chat_template is not None
    assert tok.vocab_size <= 400
    assert tok.id_to_bytes(tok.eos_token_id) == b""
    for text in TEXTS + SENTENCES[:5]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert b"".join(tok.id_to_bytes(i) for i in ids) == text.encode("utf-8")


def test_hf_incremental_equals_full_decode(bpe_dir: Path) -> None:
    tok = HFTokenizer(bpe_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, detok = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert_whole_characters(pieces)
    # The test is only meaningful if some tokens hold part of a character.
    partial = [i for i in tok.encode("👍🏽 and 🎉 你好") if not _valid_utf8(tok.id_to_bytes(i))]
    assert partial


def test_hf_stop_string_and_eos(bpe_dir: Path) -> None:
    tok = HFTokenizer(bpe_dir)
    ids = tok.encode("你好，世界！今天天气很好。") + [tok.eos_token_id]
    pieces, detok = stream(tok, ids, stop=["天气"])
    assert "".join(pieces) == "你好，世界！今天" and detok.stop_reason == "天气"


def test_hf_eos_from_config_json(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_ids == (0, 5) and tok.eos_token_id == 0 and tok.chat_template is None


def test_load_tokenizer(bpe_dir: Path, tmp_path: Path) -> None:
    hf = HFTokenizer(bpe_dir)
    assert isinstance(load_tokenizer(bpe_dir, hf.vocab_size), HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path, 512), ByteTokenizer)  # no tokenizer.json
    default = load_tokenizer(None, BYTE_VOCAB_SIZE)
    assert isinstance(default, ByteTokenizer) and default.vocab_size == BYTE_VOCAB_SIZE
    message = rf"tokenizer vocabulary \({hf.vocab_size}\) is larger than the model's embedding \(100\)"
    with pytest.raises(ValueError, match=message):
        load_tokenizer(bpe_dir, 100)
    with pytest.raises(ValueError, match="larger than the model's embedding"):
        load_tokenizer(None, 200)


def test_matches_transformers(bpe_dir: Path) -> None:
    transformers = need_module("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    tok = HFTokenizer(bpe_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_sentencepiece_style_byte_fallback(tmp_path: Path) -> None:
    """Llama-style tokenizers: "▁" marks a space and <0xNN> tokens carry raw bytes."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    vocab.update({"▁hi": 258, "▁there": 259, "▁": 260})
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.add_special_tokens(["</s>"])
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    rust.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_id == 1
    assert tok.id_to_bytes(258) == b" hi" and tok.id_to_bytes(2 + 0xE4) == b"\xe4"
    ids = [258, 259, 260] + [2 + b for b in "🎉".encode("utf-8")] + [1]
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == " hi there 🎉"
    assert_whole_characters(pieces)
    # The full decode strips the leading space; streamed text keeps it (it follows a prompt).
    assert tok.decode(ids) == "hi there 🎉"


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
