"""Constant tables a model computes itself are not buffers: a model loaded through the meta
device (model/loading/checkpoint.py) gets its buffers uninitialised and no checkpoint fills a
non-persistent one. Qwen2-VL's tower once kept its rotary frequencies in one: its outputs then
depended on what the allocator happened to hand back (a flaky CI run caught it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model.loading.checkpoint import check_no_constant_buffers, load_model
from tests.support.vision_models import save_tiny_qwen2_vl


def test_a_non_persistent_buffer_is_refused_by_name() -> None:
    model = nn.Module()
    model.tower = nn.Module()
    model.tower.register_buffer("inv_freq", torch.ones(4), persistent=False)
    model.register_buffer("codes", torch.ones(4))  # persistent: a checkpoint fills it
    with pytest.raises(TypeError, match=r"non-persistent buffers \(tower\.inv_freq\)"):
        check_no_constant_buffers(model)


def test_the_vision_towers_rotary_frequencies_load_exact(tmp_path) -> None:
    _, model = load_model(save_tiny_qwen2_vl(tmp_path / "vl", version="2.5"))
    assert dict(model.named_buffers()) == {}
    # head_dim 16: each of the row and column halves rotates 4 frequencies theta^(-2i/8)
    torch.testing.assert_close(model.visual.inv_freq.on(torch.device("cpu")), torch.tensor([1.0, 0.1, 0.01, 0.001]))
