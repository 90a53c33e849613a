"""bf16 weights packed for oneDNN multiply exactly as the plain weights do, a CPU whose
torch cannot pack falls back to the plain weights, and packed products run at a bounded
set of row counts (oneDNN builds and keeps a kernel for each one it sees)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.model import linear as linear_module
from kvchat.model.linear import EXACT_ROWS, DenseLinear, onednn_bf16_packing, packed_rows
from kvchat.model.loader import load_model
from kvchat.model.quantized_linear import PACKED_FROM_TOKENS, Int4Linear, quantize_int4_rtn
from tests.engine_helpers import Collector, small_engine

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


def test_packed_row_counts_are_few_and_pad_by_at_most_an_eighth() -> None:
    padded = {rows: packed_rows(rows) for rows in range(1, 4097)}
    assert all(padded[rows] == rows for rows in range(1, EXACT_ROWS + 1))
    assert all(rows <= p < rows * 9 / 8 for rows, p in padded.items() if rows > EXACT_ROWS)
    assert all(packed_rows(p) == p for p in padded.values())  # a padded count stays as it is
    assert len(set(padded.values())) == EXACT_ROWS + 64  # 8 counts an octave above 16 rows


class OneDNNRows:
    """Wraps oneDNN's packed product, recording the row count of every call."""

    def __init__(self) -> None:
        self.real = torch.ops.mkldnn._linear_pointwise
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, *args):
        self.rows.append(x.shape[0])
        return self.real(x, *args)


@needs_packing
def test_a_packed_layer_gives_the_plain_product_at_any_row_count(monkeypatch) -> None:
    spy = OneDNNRows()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    w, b = bf16(96, 64, seed=9), bf16(96, seed=10)
    layer = DenseLinear(w, b)
    layer.prepack()
    for rows in range(EXACT_ROWS - 2, 300):
        x = bf16(rows, 64, seed=rows)
        got = layer(x)
        assert got.shape == (rows, 96)
        assert torch.allclose(got.float(), F.linear(x.float(), w.float(), b.float()),
                              atol=0.05, rtol=0.02)  # fmt: skip
    assert set(spy.rows) == {packed_rows(rows) for rows in range(EXACT_ROWS - 2, 300)}
    assert len(set(spy.rows)) < 40  # for 286 row counts


@needs_packing
def test_prompts_of_many_lengths_reach_onednn_at_few_row_counts(tiny_llama_dir, monkeypatch):
    """Each row count oneDNN multiplies by costs it a kernel it keeps (about half a MiB
    each, up to 1,024 of them, then built again): prefills of ever new lengths made a
    long-running kvchat grow by megabytes a turn."""
    model = load_model(str(tiny_llama_dir), dtype="bfloat16", device="cpu")
    spy = OneDNNRows()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    rng = random.Random(0)
    lengths = range(17, 137)  # 120 prompt lengths, each prefilled in one step
    with small_engine(model) as engine:
        for n in lengths:
            c = Collector()
            prompt = tuple(rng.randrange(3, model.config.vocab_size) for _ in range(n))
            engine.submit(GenerationRequest(prompt, SamplingParams(), max_tokens=2), c)
            assert c.wait().reason.value in ("stop", "length")
    prefill_rows = {r for r in spy.rows if r > EXACT_ROWS}
    assert prefill_rows  # the prefills did go through the packed product
    assert prefill_rows <= {packed_rows(n) for n in lengths}
    assert len(prefill_rows) <= 25  # 8 counts an octave from 17 to 136 rows, not 120
