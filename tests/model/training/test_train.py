"""The trainer learns, its forward equals the serving forward, and the corpus is reproducible."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig
from model.layers.kv_cache import AttnMetadata, KVCache, PrefillChunk
from model.models.transformer import Transformer
from model.training.corpus import build, clean
from model.training.train import TrainConfig, lr_at, split_bytes, train
from tests.support.paths import REPO

TINY = ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, max_position=64)
TEXT = b"".join(b"the cat sat on the mat. the dog sat on the log. " for _ in range(200))


def test_training_lowers_the_validation_loss() -> None:
    cfg = TrainConfig(steps=60, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=5, eval_every=20, eval_batches=4)
    _net, history = train(TINY, TEXT, cfg, progress=False)
    first, last = history[0]["val_loss"], history[-1]["val_loss"]
    # A uniform guess over 258 byte ids costs ln(258) = 5.55 nats; this text is nearly periodic.
    assert last < first and last < 0.5 * math.log(TINY.vocab_size), history
    assert [r["step"] for r in history] == [20, 40, 60]


def test_training_is_deterministic_for_a_seed() -> None:
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=16, eval_every=3, eval_batches=2)
    a = train(TINY, TEXT, cfg, progress=False)[1]
    b = train(TINY, TEXT, cfg, progress=False)[1]
    assert [r["val_loss"] for r in a] == [r["val_loss"] for r in b]


@pytest.mark.parametrize("attention", ["dot", "additive"])
def test_training_forward_equals_the_cached_serving_forward(attention: str) -> None:
    """forward_train's causal logits are those the engine computes for a prefill."""
    net = Transformer(TINY.replace(attention=attention))
    net.init_weights(3)
    net.eval()
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = net.forward_train(tokens)[0]  # (T, vocab)
        cache = KVCache(TINY.n_layers, 4, 8, TINY.n_heads, TINY.d_head, torch.float32, "cpu")
        table = torch.tensor([2, 0, 3])  # scattered blocks
        pos = torch.arange(20)
        slots = table[pos // 8] * 8 + pos % 8
        meta = AttnMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, 20, 20, table)])
        cached = net.compute_logits(net(tokens[0], pos, meta, cache))
    torch.testing.assert_close(dense, cached, atol=1e-4, rtol=1e-4)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) < lr_at(50, cfg) < lr_at(10, cfg)
    assert lr_at(100, cfg) == pytest.approx(1e-4)


def test_validation_split_is_the_held_out_tail() -> None:
    train_ids, val_ids = split_bytes(b"abcdefghij", 0.2)
    assert bytes(train_ids.tolist()) == b"abcdefgh" and bytes(val_ids.tolist()) == b"ij"


def test_corpus_is_deterministic_and_machine_independent(tmp_path: Path) -> None:
    """Two runs in separate interpreters, from different directories, write the same bytes."""
    mods = ["json", "textwrap", "cgi", "site", "sys"]  # cgi/site/sys show the environment and paths
    outs = []
    for i in range(2):
        out = tmp_path / f"c{i}.txt"
        cwd = tmp_path if i else REPO
        subprocess.run([sys.executable, "-m", "model.training.corpus", "--out", str(out), "--modules", *mods],
                       cwd=cwd, check=True, capture_output=True, env={"PYTHONPATH": str(REPO), "HOME": str(tmp_path)})
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    text = outs[0].decode()
    manifest = json.loads((tmp_path / "c0.json").read_text())
    assert manifest["modules"] == mods and manifest["bytes"] == len(outs[0]) and "PSF" in manifest["license"]
    assert "Python Library Documentation: module textwrap" in text
    for leak in (str(REPO), str(tmp_path), sys.prefix, " at 0x"):
        assert leak not in text


def test_clean_drops_paths_addresses_and_the_environment() -> None:
    raw = ("NAME\n    m\n\nFILE\n    /secret/place/m.py\n\nDATA\n    path = ['/secret']\n\n"
           "FUNCTIONS\n    f(x=<object object at 0xdeadbeef>, env=environ({'HOME': '/secret'}))\n")
    text = clean(raw)
    assert "/secret" not in text and "0xdeadbeef" not in text and "f(x=<object object>, env=os.environ)" in text


def test_build_includes_the_project_documents() -> None:
    text, manifest = build([], REPO)
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md"))
    assert manifest["project_docs"] == ["README.md", *pages] and "docs/getting-started.md" in pages
    assert (REPO / "docs" / "getting-started.md").read_text() in text


def test_unscaled_dot_attention_only_drops_one_over_sqrt_dk() -> None:
    """The ablation of loadtests/benchmarks/attention_claims.py: scores are q.k instead of q.k / sqrt(d_k)."""
    from model.layers.attention import DotScore

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=gen) for _ in range(3))
    unscaled = DotScore(16, scaled=False).attend(q, k, v, causal_offset=0)
    torch.testing.assert_close(unscaled, DotScore(16).attend(q * 4.0, k, v, causal_offset=0))
    net = Transformer(TINY.replace(scale_scores=False))
    net.init_weights(0)
    ref = Transformer(TINY)
    ref.init_weights(0)
    tokens = torch.randint(0, 256, (1, 8), generator=gen)
    with torch.no_grad():
        assert not torch.allclose(net.forward_train(tokens), ref.forward_train(tokens))
