"""model/layers/linear/dense.py: the transposed product small row counts take on the CPU is the
same product as `F.linear` (up to float rounding), for every row count and input shape the layers
see, and the layer is an `nn.Linear` in everything but its forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.layers.linear import dense


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 16, 17, 40])
def test_linear_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    got = dense.linear(x, w, b if bias else None)
    want = F.linear(x, w, b if bias else None)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the shapes the attention layers view it as: no copy needed after
    assert got.view(rows, 3, 2, 16).shape == (rows, 3, 2, 16)


def test_small_row_counts_take_the_transposed_product(monkeypatch) -> None:
    """The branch runs where it should (another summation order: not bitwise F.linear in
    general), and not for one row, many rows or another dtype."""
    calls = []
    real_mm = torch.mm

    def spy(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    w = torch.randn(32, 16)
    dense.linear(torch.randn(4, 16), w)
    dense.linear(torch.randn(2, 2, 16), w)  # 4 rows over two leading dims
    dense.linear(torch.randn(1, 16), w)
    dense.linear(torch.randn(dense.SMALL_ROWS_MAX + 1, 16), w)
    dense.linear(torch.randn(4, 16, dtype=torch.float64), w.double())
    assert calls == [((32, 16), (16, 4)), ((32, 16), (16, 4))]


def test_three_dimensional_input_keeps_its_shape() -> None:
    layer = dense.Linear(8, 12)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)
    assert layer(x).shape == (2, 3, 12)


def test_the_layer_is_an_nn_linear() -> None:
    """Quantization and LoRA find layers by isinstance(nn.Linear); checkpoints by parameter names."""
    layer = dense.Linear(8, 12, bias=False)
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(nn.Linear(8, 12, bias=False).state_dict()) == ["weight"]
