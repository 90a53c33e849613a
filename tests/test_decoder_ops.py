"""A decoder layer's fused small ops (`kvchat/native/decoder_ops.cpp`) compute what their
torch versions compute: bit for bit in bf16 where the arithmetic is the same (add,
rotary); where a sum's order or exp differs (RMSNorm, SiLU), a few elements two bf16
steps apart at most (a flip in the intermediate rounding, scaled by the weight); to
float rounding in fp32. Also: the same on one thread as split over rows, and torch
serves where the kernels cannot."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.model import decoder_ops
from kvchat.native import build as native_build

WIDTH, HEAD_DIM, HEADS = 576, 64, 12


@pytest.fixture
def kernels(native_kernels) -> None:
    if native_build._compiler() is None or native_build.disabled():
        pytest.skip("no C++ compiler here (or the kernels are turned off)")
    assert native_kernels, native_build.status().detail


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, *, exact_bf16: bool = False) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    if ours.dtype == torch.bfloat16 and exact_bf16:
        assert torch.equal(ours, theirs)
    elif ours.dtype == torch.bfloat16:  # at most two bf16 steps apart, in few elements
        differ = ours != theirs
        assert differ.float().mean() < 0.005
        two_steps = theirs.float().abs() * 2**-6
        assert bool(((ours.float() - theirs.float()).abs() <= two_steps + 1e-30).all())
    else:
        torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=1e-6)


ROWS = [1, 5, 300]  # 300 rows split over threads
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_torch(kernels, rows, dtype):
    x = _randn(rows, WIDTH, dtype=dtype, seed=1, scale=3.0)
    weight = (torch.rand(WIDTH, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    reference = decoder_ops.rms_norm_reference(x, weight, 1e-5)
    _assert_same(torch.ops.kvchat.rms_norm(x, weight, 1e-5), reference)
    _assert_same(decoder_ops.rms_norm(x, weight, 1e-5), reference)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_add_then_norm(kernels, rows, dtype):
    h = _randn(rows, WIDTH, dtype=dtype, seed=3, scale=3.0)
    delta = _randn(rows, WIDTH, dtype=dtype, seed=4)
    weight = (torch.rand(WIDTH, generator=torch.Generator().manual_seed(5)) + 0.5).to(dtype)
    total, normed = decoder_ops.add_rms_norm(h, delta, weight, 1e-6)
    assert torch.equal(total, h + delta)
    _assert_same(normed, decoder_ops.rms_norm_reference(h + delta, weight, 1e-6))


def test_add_rms_norm_without_delta_keeps_the_stream(kernels):
    h = _randn(2, WIDTH, dtype=torch.bfloat16, seed=6)
    weight = torch.ones(WIDTH, dtype=torch.bfloat16)
    total, normed = decoder_ops.add_rms_norm(h, None, weight, 1e-6)
    assert total is h
    _assert_same(normed, decoder_ops.rms_norm_reference(h, weight, 1e-6))


def _factor(width: int, seed: int) -> torch.Tensor:
    """A Gemma norm's float32 (1 + w) factor."""
    return 1.0 + torch.randn(width, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norms_equal_transformers_rounding(kernels, rows, dtype):
    """Gemma's norm, its residual forms and its per-head q/k norms against the torch
    sequence transformers runs (the factor applied in float32, one rounding)."""
    h = _randn(rows, WIDTH, dtype=dtype, seed=20, scale=3.0)
    y = _randn(rows, WIDTH, dtype=dtype, seed=21, scale=5.0)
    post, pre = _factor(WIDTH, 22), _factor(WIDTH, 23)
    reference = decoder_ops.gemma_norm_reference
    _assert_same(decoder_ops.gemma_norm(h, pre, 1e-6), reference(h, pre, 1e-6))
    total, normed = decoder_ops.gemma_add_norm(h, y, post, pre, 1e-6)
    expected_total = h + reference(y, post, 1e-6)
    _assert_same(total, expected_total)
    _assert_same(normed, reference(expected_total, pre, 1e-6))
    total, normed = decoder_ops.gemma_add_norm(h, y, None, pre, 1e-6)
    assert torch.equal(total, h + y)
    _assert_same(normed, reference(h + y, pre, 1e-6))

    qkv = _randn(rows, (HEADS + 5) * HEAD_DIM, dtype=dtype, seed=24, scale=2.0)
    q_factor, k_factor = _factor(HEAD_DIM, 25), _factor(HEAD_DIM, 26)
    normed_heads = qkv.clone()
    decoder_ops.gemma_heads_norm_(normed_heads, q_factor, k_factor, HEADS - 2, 2, 1e-6)
    heads = qkv.view(rows, HEADS + 5, HEAD_DIM)
    expected = torch.cat(
        [
            reference(heads[:, : HEADS - 2], q_factor, 1e-6),
            reference(heads[:, HEADS - 2 : HEADS], k_factor, 1e-6),
            heads[:, HEADS:],
        ],
        dim=1,
    )
    _assert_same(normed_heads, expected.reshape(rows, -1))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_equals_torch(kernels, rows, dtype):
    """Within two bf16 steps of torch's, or 1e-5 of it: for gates near -5, 1 + tanh(...)
    cancels to the last float bit (torch's own scalar and vector tanh then differ, -1.5e-7
    against 0)."""
    gate_up = _randn(rows, 2 * 1040, dtype=dtype, seed=27, scale=4.0)  # a width past 32s
    gate, up = gate_up.chunk(2, dim=-1)
    ours, theirs = decoder_ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    if dtype == torch.bfloat16:
        assert (ours != theirs).float().mean() < 0.005
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2**-6, atol=1e-5)
    else:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_gemma_norms_refuse_a_factor_of_the_wrong_kind(kernels):
    x = _randn(2, WIDTH, dtype=torch.bfloat16, seed=28)
    with pytest.raises(RuntimeError, match=r"\(1 \+ w\) factor float32"):
        torch.ops.kvchat.gemma_rms_norm(x, torch.ones(WIDTH, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(kernels, rows, dtype):
    """The layer's fused qkv rows: the first HEADS heads rotated, the rest untouched."""
    qkv = _randn(rows, (HEADS + 3) * HEAD_DIM, dtype=dtype, seed=7)
    cos = _randn(rows, HEAD_DIM, dtype=dtype, seed=8)
    sin = _randn(rows, HEAD_DIM, dtype=dtype, seed=9)
    heads = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    expected = decoder_ops.rotary_reference(heads, cos.unsqueeze(1), sin.unsqueeze(1))
    rotated = qkv.clone()
    decoder_ops.rotate_(rotated, cos, sin, HEADS)
    _assert_same(rotated[:, : HEADS * HEAD_DIM], expected.reshape(rows, -1), exact_bf16=True)
    assert torch.equal(rotated[:, HEADS * HEAD_DIM :], qkv[:, HEADS * HEAD_DIM :])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_torch(kernels, rows, dtype):
    gate_up = _randn(rows, 2 * 1536, dtype=dtype, seed=10, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    ours = decoder_ops.silu_mul(gate_up)
    _assert_same(ours, F.silu(gate) * up)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_large_gates_is_finite(kernels, dtype):
    """Gates far below zero make exp overflow; the result must still be ~0, never NaN
    (a tiny random GGUF model met this: NaN logits)."""
    gate_up = _randn(4, 2 * 128, dtype=dtype, seed=17, scale=1000.0)
    gate, up = gate_up.chunk(2, dim=-1)
    ours = decoder_ops.silu_mul(gate_up)
    assert bool(ours.isfinite().all())
    torch.testing.assert_close(ours.float(), (F.silu(gate) * up).float(), rtol=1e-2, atol=1e-30)


@pytest.mark.parametrize("op", ["rms_norm", "rotary", "silu_mul"])
def test_rows_split_over_threads_equal_rows_one_by_one(kernels, op):
    """Each row's result is its own: a long prefill computes what a decode would."""
    rows = 300
    x = _randn(rows, (HEADS + 3) * HEAD_DIM, dtype=torch.bfloat16, seed=11, scale=2.0)
    cos = _randn(rows, HEAD_DIM, dtype=torch.bfloat16, seed=12)
    sin = _randn(rows, HEAD_DIM, dtype=torch.bfloat16, seed=13)

    def run(part: slice) -> torch.Tensor:
        if op == "rms_norm":
            y = x[part, :WIDTH].contiguous()
            return decoder_ops.rms_norm(y, torch.ones(WIDTH, dtype=y.dtype), 1e-5)
        if op == "silu_mul":
            return decoder_ops.silu_mul(x[part].contiguous())
        y = x[part].clone()
        decoder_ops.rotate_(y, cos[part].contiguous(), sin[part].contiguous(), HEADS)
        return y

    whole = run(slice(0, rows))
    one_by_one = torch.cat([run(slice(r, r + 1)) for r in range(rows)])
    assert torch.equal(whole, one_by_one)


def test_torch_serves_dtypes_the_kernels_lack(kernels):
    """float16 is not compiled: the wrappers fall back to torch instead of failing."""
    x = _randn(3, WIDTH, dtype=torch.float16, seed=14)
    weight = torch.ones(WIDTH, dtype=torch.float16)
    _assert_same(
        decoder_ops.rms_norm(x, weight, 1e-5), decoder_ops.rms_norm_reference(x, weight, 1e-5)
    )
    gate_up = _randn(3, 64, dtype=torch.float16, seed=15)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(decoder_ops.silu_mul(gate_up), F.silu(gate) * up)


def test_kernels_refuse_mismatched_inputs_with_a_message(kernels):
    x = _randn(2, WIDTH, dtype=torch.bfloat16, seed=16)
    with pytest.raises(RuntimeError, match="norm weight"):
        torch.ops.kvchat.rms_norm(x, torch.ones(WIDTH, dtype=torch.float32), 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul"):
        torch.ops.kvchat.silu_mul(x[:, :575].contiguous())
