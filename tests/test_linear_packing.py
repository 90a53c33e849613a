"""bf16 weights packed for oneDNN multiply exactly as the plain weights do, a CPU whose
torch cannot pack falls back to the plain weights, and packed products run at a bounded
set of row counts (oneDNN builds and keeps a kernel for each one it sees)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.model import linear as linear_module
from kvchat.model.linear import (
    EXACT_ROWS,
    HOT_ROWS,
    KERNEL_CACHE_VARIABLES,
    SPARE_ROW_COUNTS,
    DenseLinear,
    bounded_kernel_caches,
    kernel_cache_capacity,
    onednn_bf16_packing,
    packed_rows,
)
from kvchat.model.loader import load_model
from kvchat.model.quantized_linear import PACKED_FROM_TOKENS, Int4Linear, quantize_int4_rtn
from tests.engine_helpers import Collector, small_engine

ROOT = Path(__file__).resolve().parents[1]

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


def test_packed_row_counts_are_few_and_pad_by_less_than_a_quarter() -> None:
    padded = {rows: packed_rows(rows) for rows in range(1, 4097)}
    assert all(padded[rows] == rows for rows in range(1, EXACT_ROWS + 1))
    assert all(rows <= p < rows * 5 / 4 for rows, p in padded.items() if rows > EXACT_ROWS)
    assert all(packed_rows(p) == p for p in padded.values())  # a padded count stays as it is
    assert len(set(padded.values())) == EXACT_ROWS + 36  # 4 counts an octave above 8 rows
    hot = {padded[rows] for rows in range(PACKED_FROM_TOKENS, HOT_ROWS + 1)}
    assert hot == {10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64}


def test_the_kernel_caches_keep_every_frequent_kernel_and_a_few_long_ones() -> None:
    def layers(make) -> list:
        # a layer's four matrices (q/k/v, o, gate/up, down) times 3 layers: four shapes
        shapes = [(96, 64), (64, 64), (256, 64), (64, 128)] * 3
        return [make(torch.zeros(shape, dtype=torch.bfloat16)) for shape in shapes]

    dense = layers(DenseLinear)  # every row count packed: 8 exact + 12 up to 64 rows
    assert kernel_cache_capacity(dense) == 4 * (8 + 12) + 4 * SPARE_ROW_COUNTS
    codes = torch.zeros(96, 64, dtype=torch.int64)
    scales = torch.ones(96, 2)

    def int4_with(dense_copy):  # packed from 10 rows only: 12 counts up to 64
        return Int4Linear(codes, scales, scales, torch.bfloat16, dense=dense_copy)

    assert kernel_cache_capacity([int4_with(torch.zeros(96, 64, dtype=torch.bfloat16))]) == 12 + 4
    assert kernel_cache_capacity([int4_with(None)]) == 0  # no dense copy: nothing packed
    assert kernel_cache_capacity([DenseLinear(torch.zeros(96, 64))]) == 0  # float32


def test_a_capacity_the_user_set_is_kept_and_ours_is_not_left_behind(monkeypatch) -> None:
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    with bounded_kernel_caches([DenseLinear(torch.zeros(96, 64, dtype=torch.bfloat16))]):
        assert os.environ["LRU_CACHE_CAPACITY"] == "500"
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(8 + 12 + SPARE_ROW_COUNTS)
    assert os.environ["LRU_CACHE_CAPACITY"] == "500"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ  # child processes: no cap


CAPPED_CACHE_PROBE = """
import torch
from kvchat.model.linear import DenseLinear, bounded_kernel_caches
g = torch.Generator().manual_seed(0)
layer = DenseLinear(torch.randn(96, 64, generator=g).to(torch.bfloat16))
with bounded_kernel_caches([layer]):
    layer.prepack()
x = lambda rows: torch.randn(rows, 64, generator=g).to(torch.bfloat16)
print("MARK hot", flush=True)
layer(x(16))
print("MARK long", flush=True)
for rows in range(72, 72 + 40 * 16, 16):  # 40 long steps, about 30 row counts
    layer(x(rows))
print("MARK hot again", flush=True)
layer(x(16))
"""


@needs_packing
def test_a_kernel_evicted_by_long_steps_is_built_again() -> None:
    """The cap is live in oneDNN (not only in the environment): after more long row counts
    than the spare room, the first kernel built is gone. Without the cap it stays."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES}
    env["ONEDNN_VERBOSE"] = "profile_create"
    probe = [sys.executable, "-c", CAPPED_CACHE_PROBE]
    run = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    after_long = out.split("MARK hot again")[1]
    built_again = [line for line in after_long.splitlines() if "cache_miss" in line]
    assert any("inner_product" in line and "mb16" in line for line in built_again), out[-2000:]


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
    assert len(set(spy.rows)) == 24  # for 294 row counts


@needs_packing
def test_prompts_of_many_lengths_reach_onednn_at_few_row_counts(tiny_llama_dir, monkeypatch):
    """Each row count oneDNN multiplies by costs it a kernel it keeps (up to a few MiB
    each): prefills of ever new lengths made a long-running kvchat grow by megabytes a
    turn."""
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
    assert len(prefill_rows) <= 13  # 4 counts an octave from 17 to 136 rows, not 120
