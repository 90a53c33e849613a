"""bf16 weights packed for oneDNN multiply exactly as the plain weights do, and a CPU
whose torch cannot pack falls back to the plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.model import linear as linear_module
from kvchat.model.linear import DenseLinear, onednn_bf16_packing
from kvchat.model.quantized_linear import PACKED_FROM_TOKENS, Int4Linear, quantize_int4_rtn

needs_packing = pytest.mark.skipif(
    not onednn_bf16_packing(), reason="this CPU's torch does not pack bf16 weights for oneDNN"
)


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_a_packed_dense_linear_gives_the_plain_product(rows: int) -> None:
    w, b, x = bf16(96, 64, seed=1), bf16(96, seed=2), bf16(rows, 64, seed=3)
    expected = F.linear(x.float(), w.float(), b.float())
    layer = DenseLinear(w, b)
    layer.prepack()
    assert layer.packed is not None and layer.weight is None  # packed replaces the plain copy
    assert layer.nbytes() == w.numel() * 2
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert torch.allclose(got.float(), expected, atol=0.05, rtol=0.02)


@needs_packing
def test_an_int4_layer_uses_its_packed_dense_copy_for_many_rows_only() -> None:
    w = bf16(64, 96, seed=4)
    codes, scales, offsets = quantize_int4_rtn(w.float())
    layer = Int4Linear(codes, scales, offsets, torch.bfloat16, dense=w)
    layer.prepack()
    assert layer.dense is None and layer.dense_packed is not None
    few, many = bf16(2, 96, seed=5), bf16(PACKED_FROM_TOKENS, 96, seed=6)
    dequantized = layer.dequantized().float()
    # few rows: the int4 kernel (the 4-bit weight); many: the packed dense copy (the bf16 weight)
    assert torch.allclose(layer(few).float(), few.float() @ dequantized.t(), atol=0.1, rtol=0.02)
    exact = many.float() @ w.float().t()
    assert torch.allclose(layer(many).float(), exact, atol=0.05, rtol=0.02)
    assert not torch.allclose(many.float() @ dequantized.t(), exact, atol=0.05, rtol=0.02)


def test_without_onednn_packing_the_plain_weight_is_used(monkeypatch) -> None:
    monkeypatch.setattr(linear_module, "onednn_bf16_packing", lambda: False)
    w, x = bf16(32, 64, seed=7), bf16(4, 64, seed=8)
    layer = DenseLinear(w)
    layer.prepack()
    assert layer.packed is None and layer.weight is w
    assert torch.equal(layer(x), F.linear(x, w))


def test_float32_weights_are_not_packed() -> None:
    layer = DenseLinear(torch.randn(32, 64))
    layer.prepack()
    assert layer.packed is None  # no gain measured for float32
