"""model/layers/linear/dense.py: the transposed product small row counts take on the CPU and the
dense kernel (csrc/dense_matmul.cpp) are the same product as `F.linear` (up to float rounding),
for every row count and input shape the layers see, and the layer is an `nn.Linear` in
everything but its forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from model.layers.linear import dense
from tests.support.requirements import in_ci


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
    monkeypatch.setitem(dense._use_kernel, "on", False)
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


# Under CI the kernel must build: these tests then run (and fail) instead of skipping.
needs_kernel = pytest.mark.skipif(not dense.kernel_available() and not in_ci(), reason="the dense kernel does not build here")


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows,k,n", [(1, 768, 2304), (2, 64, 96), (3, 100, 7), (4, 3072, 768), (5, 17, 1),
                                      (9, 256, 130), (33, 64, 64), (64, 128, 257)])
def test_the_kernel_equals_f_linear(rows: int, k: int, n: int, bias: bool) -> None:
    """Every tail: rows not a multiple of 4, N not a multiple of 4, K not a multiple of the vector width."""
    gen = torch.Generator().manual_seed(rows * k + n)
    w, b = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    got = torch.ops.qkv_dense.dense_matmul(x, w, b if bias else x.new_empty(0))
    torch.testing.assert_close(got, F.linear(x, w, b if bias else None), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_inference_products_of_up_to_kernel_max_rows_take_the_kernel(monkeypatch) -> None:
    """Under no_grad, 1..KERNEL_MAX_ROWS float32 rows go through the kernel; more rows, another
    dtype, a transposed weight and autograd (training) do not."""
    monkeypatch.setitem(dense._use_kernel, "on", True)
    calls = []
    real = torch.ops.qkv_dense.dense_matmul

    class Spy:
        @staticmethod
        def dense_matmul(x, w, b):
            calls.append(tuple(x.shape))
            return real(x, w, b)

    monkeypatch.setattr(torch.ops, "qkv_dense", Spy)
    w = torch.randn(32, 16, requires_grad=True)
    with torch.no_grad():
        for rows in (1, 4, dense.KERNEL_MAX_ROWS):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(dense.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        dense.linear(torch.randn(2, 3, 16), w)  # 6 rows over two leading dims
        dense.linear(torch.randn(dense.KERNEL_MAX_ROWS + 1, 16), w)
        dense.linear(torch.randn(4, 16, dtype=torch.float64), w.double())
        dense.linear(torch.randn(4, 16), torch.randn(16, 32).t())
    y = dense.linear(torch.randn(4, 16), w)  # autograd: the kernel has no backward
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    assert calls == [(1, 16), (4, 16), (dense.KERNEL_MAX_ROWS, 16), (6, 16)]
