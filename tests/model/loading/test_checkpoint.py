"""Checkpoint directories: exact round trips of our presets and of GPT-2, HF can read what we
write, and every bad checkpoint fails with a message that says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import model.loading.checkpoint as checkpoint
from model.config import PRESETS, ModelConfig
from model.loading.checkpoint import SUPPORTED_ARCHITECTURES, CheckpointError, load_model, save_model
from model.models.transformer import Transformer
from tests.support.tiny_models import build_tiny_gpt2, full_logits, save_tiny_gpt2
from tests.support.requirements import need_module

transformers = need_module("transformers")

TOKENS = torch.tensor([5, 17, 200, 3, 99, 42, 7, 250, 1, 64, 128, 31])


def _assert_same_params(a: Transformer, b: Transformer) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), f"{name} differs after the round trip"


@pytest.mark.parametrize("preset", ["transformer-base", "transformer-base-additive"])
def test_preset_round_trip_is_exact(preset: str, tmp_path: Path) -> None:
    cfg = PRESETS[preset]
    model = Transformer(cfg).eval()
    model.init_weights(cfg.init_seed)
    save_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["QKVTransformerForCausalLM"]
    loaded_cfg, loaded = load_model(tmp_path)
    assert loaded_cfg == cfg
    _assert_same_params(model, loaded)
    assert torch.equal(full_logits(model, TOKENS), full_logits(loaded, TOKENS))


def _random_gpt2() -> Transformer:
    """Our gpt2 arch with every parameter random (biases and LayerNorms included)."""
    cfg = ModelConfig(vocab_size=301, d_model=64, n_heads=4, n_layers=2, d_ff=192, max_position=64,
                      arch="gpt2")
    model = Transformer(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def test_gpt2_round_trip_is_exact_and_loads_in_hf(tmp_path: Path) -> None:
    model = _random_gpt2()
    save_model(model, tmp_path)
    cfg, loaded = load_model(tmp_path)
    assert cfg == model.cfg
    _assert_same_params(model, loaded)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = hf(TOKENS[None]).logits[0]
    torch.testing.assert_close(full_logits(loaded, TOKENS), expected, atol=1e-4, rtol=0)


def test_gpt2_model_keys_without_prefix(tmp_path: Path) -> None:
    """`GPT2Model` checkpoints name tensors `h.0...` instead of `transformer.h.0...`."""
    hf = build_tiny_gpt2(n_layer=2, n_head=2, n_embd=32, vocab_size=263, seed=4).transformer
    hf.save_pretrained(tmp_path)
    _, model = load_model(tmp_path)
    with torch.no_grad():
        expected = hf(TOKENS[None]).last_hidden_state[0]
    torch.testing.assert_close(full_logits(model, TOKENS), expected @ hf.wte.weight.T, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return save_tiny_gpt2(tmp_path_factory.mktemp("gpt2"), n_layer=1, n_head=2, n_embd=32, vocab_size=263,
                          with_tokenizer=False)


@pytest.fixture
def bad_dir(gpt2_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the tiny GPT-2 checkpoint, free to break."""
    return Path(shutil.copytree(gpt2_dir, tmp_path / "ckpt"))


def _edit_tensors(directory: Path, edit) -> None:
    file = directory / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_tied_lm_head_and_old_mask_buffers_are_accepted(bad_dir: Path, gpt2_dir: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["transformer.wte.weight"].clone()
        t["transformer.h.0.attn.bias"] = torch.ones(1, 1, 128, 128).tril()
        t["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)

    _edit_tensors(bad_dir, add)
    _, with_head = load_model(bad_dir)
    _, plain = load_model(gpt2_dir)
    _assert_same_params(with_head, plain)


def test_tokenizer_kind_follows_tokenizer_json(tmp_path: Path, gpt2_dir: Path) -> None:
    assert load_model(gpt2_dir)[0].tokenizer == "byte"
    with_tok = save_tiny_gpt2(tmp_path, n_layer=1, n_head=2, n_embd=32, vocab_size=263)
    assert load_model(with_tok)[0].tokenizer == "hf"


def test_large_load_shows_progress_bar(gpt2_dir: Path, monkeypatch, capsys) -> None:
    load_model(gpt2_dir)
    assert "loading" not in capsys.readouterr().err
    monkeypatch.setattr(checkpoint, "PROGRESS_MIN_BYTES", 0)
    load_model(gpt2_dir)
    assert "loading" in capsys.readouterr().err


def _error(directory: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(directory)
    return str(info.value)


def test_missing_directory(tmp_path: Path) -> None:
    msg = _error(tmp_path / "nope")
    assert "does not exist" in msg and "nope" in msg


def test_missing_config_json(bad_dir: Path) -> None:
    (bad_dir / "config.json").unlink()
    msg = _error(bad_dir)
    assert "no config.json" in msg and str(bad_dir) in msg


def test_unknown_architecture_lists_supported(bad_dir: Path) -> None:
    raw = json.loads((bad_dir / "config.json").read_text())
    raw["architectures"], raw["model_type"] = ["GemmaForCausalLM"], "gemma"
    (bad_dir / "config.json").write_text(json.dumps(raw))
    msg = _error(bad_dir)
    assert "GemmaForCausalLM" in msg
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg
    assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_activation(bad_dir: Path) -> None:
    raw = json.loads((bad_dir / "config.json").read_text())
    raw["activation_function"] = "relu"
    (bad_dir / "config.json").write_text(json.dumps(raw))
    msg = _error(bad_dir)
    assert "'relu'" in msg and "gelu_new" in msg


def test_shape_mismatch_names_tensor_and_shapes(bad_dir: Path) -> None:
    def shrink(t: dict[str, torch.Tensor]) -> None:
        t["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(32, 100)

    _edit_tensors(bad_dir, shrink)
    msg = _error(bad_dir)
    assert "transformer.h.0.mlp.c_fc.weight" in msg and "[32, 100]" in msg and "[32, 128]" in msg


def test_missing_tensor_is_named(bad_dir: Path) -> None:
    _edit_tensors(bad_dir, lambda t: t.pop("transformer.h.0.ln_2.bias"))
    msg = _error(bad_dir)
    assert "missing" in msg and "transformer.h.0.ln_2.bias" in msg


def test_unexpected_tensor_is_named(bad_dir: Path) -> None:
    def add(t: dict[str, torch.Tensor]) -> None:
        t["transformer.h.7.attn.c_attn.weight"] = torch.zeros(32, 96)

    _edit_tensors(bad_dir, add)
    msg = _error(bad_dir)
    assert "unexpected" in msg and "transformer.h.7.attn.c_attn.weight" in msg


def test_untied_lm_head_is_refused(bad_dir: Path) -> None:
    _edit_tensors(bad_dir, lambda t: t.__setitem__("lm_head.weight", torch.zeros_like(t["transformer.wte.weight"])))
    assert "lm_head.weight" in _error(bad_dir)


def test_missing_weights_file(bad_dir: Path) -> None:
    (bad_dir / "model.safetensors").unlink()
    msg = _error(bad_dir)
    assert "no weights" in msg and "model.safetensors" in msg


def test_missing_shard_is_named(tmp_path: Path) -> None:
    directory = save_tiny_gpt2(tmp_path, n_layer=1, n_head=2, n_embd=32, vocab_size=263, sharded=True,
                               with_tokenizer=False)
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.unlink()
    msg = _error(directory)
    assert shard.name in msg and "missing" in msg


def test_truncated_weights_file_is_named(bad_dir: Path) -> None:
    file = bad_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    msg = _error(bad_dir)
    assert "model.safetensors is truncated" in msg


def test_weights_file_that_is_not_safetensors(bad_dir: Path) -> None:
    (bad_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "is not a safetensors file" in _error(bad_dir)


def test_bf16_weights_load_exactly_into_float32(tmp_path: Path) -> None:
    model = _random_gpt2().to(torch.bfloat16)
    save_model(model, tmp_path)
    cfg, loaded = load_model(tmp_path, dtype=torch.float32)
    assert checkpoint.checkpoint_dtype(tmp_path) == torch.bfloat16
    for (name, a), b in zip(model.named_parameters(), loaded.parameters()):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b), name
