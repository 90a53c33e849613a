"""kvchat's quantized kernels (`q4_matmul`, `q8_matmul`) against a float64 product of
the weights the GGUF dequantizer reads from the same random blocks: every format (Q6_K
with its scale per 16 included), odd shapes, every row count path (fused decode rows,
the buffered tiles, a ragged tail)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvchat.model.gguf.dequant import dequantize, unpack_int8, unpack_q4
from kvchat.model.gguf.file import GGMLType
from kvchat.model.quantized_linear import Q4Linear, Q8Linear, expanded
from kvchat.native import build as native_build

pytestmark = pytest.mark.usefixtures("kernel")

BLOCK = {
    GGMLType.Q4_0: (32, 18),
    GGMLType.Q4_1: (32, 20),
    GGMLType.Q4_K: (256, 144),
    GGMLType.Q5_0: (32, 22),
    GGMLType.Q6_K: (256, 210),
}
ROW_COUNTS = [1, 2, 3, 4, 5, 8, 16, 17, 24, 64, 130]


@pytest.fixture
def kernel(native_kernels) -> None:
    if native_build._compiler() is None or native_build.disabled():
        pytest.skip("no C++ compiler here (or the kernel is turned off)")
    assert native_kernels, native_build.status().detail


def _f16(rng: np.random.Generator, count: int, low: float, high: float) -> np.ndarray:
    return rng.uniform(low, high, count).astype(np.float16).view(np.uint8).reshape(count, 2)


def random_blocks(ggml_type: GGMLType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes of a [rows, cols] matrix: random codes, sub-scales and f16 scales
    of a plausible size (both signs for the offsets)."""
    rng = np.random.default_rng(seed)
    if ggml_type == GGMLType.Q8_0:
        count = rows * cols // 32
        codes = rng.integers(-128, 128, (count, 32), dtype=np.int8).view(np.uint8)
        return np.concatenate([_f16(rng, count, -0.02, 0.02), codes], axis=1).reshape(-1)
    per_block, nbytes = BLOCK[ggml_type]
    count = rows * cols // per_block
    if ggml_type == GGMLType.Q6_K:  # codes, then 16 signed sub-scales, then the f16 d
        codes = rng.integers(0, 256, (count, 192), dtype=np.uint8)
        sub = rng.integers(-128, 128, (count, 16), dtype=np.int8).view(np.uint8)
        return np.concatenate([codes, sub, _f16(rng, count, 0.0001, 0.002)], axis=1).reshape(-1)
    parts = [_f16(rng, count, 0.001, 0.03)]
    if ggml_type == GGMLType.Q4_1:
        parts.append(_f16(rng, count, -0.2, 0.2))
    if ggml_type == GGMLType.Q4_K:
        parts.append(_f16(rng, count, 0.0, 0.01))
    used = sum(p.shape[1] for p in parts)
    parts.append(rng.integers(0, 256, (count, nbytes - used), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(-1)


def close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Equal to the float64 product up to float32 summation order: the error bound
    scales with the sum of the terms' magnitudes."""
    exact = x.double() @ w.double().t()
    bound = 2e-6 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    worst = ((y.double() - exact).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the float32 bound"


@pytest.mark.parametrize(
    ("ggml_type", "compact"),
    [(GGMLType.Q4_0, False), (GGMLType.Q4_1, False), (GGMLType.Q4_K, False), (GGMLType.Q4_K, True)],
)
@pytest.mark.parametrize("out_features", [1, 7, 33, 97])
def test_q4_kernel_computes_the_dequantized_weights(ggml_type, compact, out_features):
    in_features = 512 if ggml_type == GGMLType.Q4_K else 96
    raw = random_blocks(ggml_type, out_features, in_features, seed=out_features)
    shape = (out_features, in_features)
    weight = dequantize(raw, ggml_type, shape).float()
    blocks = unpack_q4(raw, ggml_type, shape, compact=compact)
    supers = (blocks.scale_supers, blocks.offset_supers) if compact else ()
    layer = Q4Linear(blocks.codes, blocks.scales, blocks.offsets, *supers)
    if compact:  # the file's 6-bit sub-scales and sub-mins, a byte each
        assert layer.scales.dtype == torch.uint8 and layer.offsets.dtype == torch.uint8
    assert torch.equal(layer.dequantized(), weight)
    g = torch.Generator().manual_seed(1)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=g)
        close_to_exact(layer(x), x, weight)
        if not compact:
            # float32 scales (a file's values that float16 cannot hold) take the same path
            y = torch.ops.kvchat.q4_matmul(
                x, layer.codes, layer.scales.float(), layer.offsets.float()
            )
            close_to_exact(y, x, weight)


@pytest.mark.parametrize(
    ("ggml_type", "compact"),
    [(GGMLType.Q8_0, False), (GGMLType.Q5_0, False), (GGMLType.Q6_K, False), (GGMLType.Q6_K, True)],
)
@pytest.mark.parametrize("out_features", [1, 5, 64, 131])
def test_q8_kernel_computes_the_dequantized_weights(ggml_type, compact, out_features):
    in_features = 512 if ggml_type == GGMLType.Q6_K else 160
    raw = random_blocks(ggml_type, out_features, in_features, seed=out_features)
    shape = (out_features, in_features)
    weight = dequantize(raw, ggml_type, shape).float()
    blocks = unpack_int8(raw, ggml_type, shape, compact=compact)
    assert blocks.group == (16 if ggml_type == GGMLType.Q6_K else 32)
    layer = Q8Linear(blocks.codes, blocks.scales, *((blocks.scale_supers,) if compact else ()))
    if compact:  # the file's int8 sub-scales, a byte each
        assert layer.scales.dtype == torch.int8
    if ggml_type != GGMLType.Q6_K:  # a GGUF's f16 scales are kept as they are
        assert layer.scales.dtype == torch.float16
    assert torch.equal(layer.dequantized(), weight)
    g = torch.Generator().manual_seed(2)
    for rows in ROW_COUNTS:
        x = torch.randn(rows, in_features, generator=g)
        close_to_exact(layer(x), x, weight)


def test_a_scale_per_16_columns_is_not_read_as_one_per_32():
    """The two halves of a group are scaled apart: with the second half's scales zeroed,
    only the first halves count."""
    raw = random_blocks(GGMLType.Q6_K, 8, 256, seed=5)
    blocks = unpack_int8(raw, GGMLType.Q6_K, (8, 256))
    scales = blocks.scales.clone()
    scales[:, 1::2] = 0
    layer = Q8Linear(blocks.codes, scales)
    halves = layer.dequantized().reshape(8, 8, 2, 16)
    assert halves[:, :, 1].abs().max() == 0 and halves[:, :, 0].abs().max() > 0
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    close_to_exact(layer(x), x, layer.dequantized())


@pytest.mark.parametrize("rows", [3, 16, 40])
def test_long_rows_are_tiled_along_k_too(rows):
    """K past one tile's columns (2048), with a ragged last tile: the partial products
    accumulate into the same outputs."""
    raw = random_blocks(GGMLType.Q4_0, 40, 4160, seed=rows)
    weight = dequantize(raw, GGMLType.Q4_0, (40, 4160)).float()
    blocks = unpack_q4(raw, GGMLType.Q4_0, (40, 4160))
    layer = Q4Linear(blocks.codes, blocks.scales, blocks.offsets)
    x = torch.randn(rows, 4160, generator=torch.Generator().manual_seed(rows))
    close_to_exact(layer(x), x, weight)


def _column_scales(layer) -> torch.Tensor:
    """Each weight's scale magnitude, [N, K]: what bounds the error of the bf16
    dot-product path, whose codes carry a bias of up to 160 scales."""
    scales = expanded(layer.scales, getattr(layer, "scale_supers", None))
    per = layer.in_features // scales.shape[1]
    return scales.abs().repeat_interleave(per, dim=1)


@pytest.mark.parametrize(
    ("ggml_type", "compact"),
    [(GGMLType.Q4_0, False), (GGMLType.Q4_1, False), (GGMLType.Q4_K, False),
     (GGMLType.Q4_K, True), (GGMLType.Q5_0, False), (GGMLType.Q6_K, False),
     (GGMLType.Q6_K, True), (GGMLType.Q8_0, False)],
)  # fmt: skip
@pytest.mark.parametrize("out_features", [1, 7, 33])
def test_bf16_activations_give_the_product_of_their_values(ggml_type, compact, out_features):
    """bf16 rows (decode batches take the dot-product path where the CPU has it): within
    bf16's rounding of the float64 product, plus float32 sums of the biased codes. Odd
    group counts and a block of 16 scales with a remainder (1,120 columns) included, and
    the K-quants' integer sub-scales with their super-scales."""
    k_quant = ggml_type in (GGMLType.Q4_K, GGMLType.Q6_K)
    for k in (1280,) if k_quant else (1120, 96):
        raw = random_blocks(ggml_type, out_features, k, seed=out_features + k)
        shape = (out_features, k)
        if ggml_type in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K):
            blocks = unpack_q4(raw, ggml_type, shape, compact=compact)
            supers = (blocks.scale_supers, blocks.offset_supers) if compact else ()
            layer = Q4Linear(blocks.codes, blocks.scales, blocks.offsets, *supers)
        else:
            blocks = unpack_int8(raw, ggml_type, shape, compact=compact)
            supers = (blocks.scale_supers,) if compact else ()
            layer = Q8Linear(blocks.codes, blocks.scales, *supers)
            assert layer.small_codes == (ggml_type != GGMLType.Q8_0)
        assert (layer.scales.dtype in (torch.int8, torch.uint8)) == compact
        weight = layer.dequantized().double()
        scales = _column_scales(layer).double()
        g = torch.Generator().manual_seed(k)
        for rows in (1, 2, 3, 4, 5):
            x = torch.randn(rows, k, generator=g).bfloat16()
            y = layer(x)
            assert y.dtype == torch.bfloat16
            exact = x.double() @ weight.t()
            sums = x.double().abs() @ (weight.abs() + 160 * scales).t()
            bound = 2**-8 * exact.abs() + 2e-5 * sums + 1e-6
            worst = ((y.double() - exact).abs() / bound).max().item()
            assert worst <= 1.0, f"{rows} rows, K {k}: error {worst:.2f}x the bound"


def test_misshapen_arguments_are_refused_with_the_reason():
    raw = random_blocks(GGMLType.Q4_0, 16, 64, seed=4)
    blocks = unpack_q4(raw, GGMLType.Q4_0, (16, 64))
    layer = Q4Linear(blocks.codes, blocks.scales, blocks.offsets)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.kvchat.q4_matmul(torch.randn(1, 48), layer.codes, layer.scales, layer.offsets)
    with pytest.raises(RuntimeError, match="codes"):
        torch.ops.kvchat.q4_matmul(torch.randn(1, 96), layer.codes, layer.scales, layer.offsets)
    with pytest.raises(RuntimeError, match="offsets"):
        torch.ops.kvchat.q4_matmul(
            torch.randn(1, 64), layer.codes, layer.scales, layer.offsets.float()
        )
    with pytest.raises(RuntimeError, match="super-scales"):  # integer scales alone
        torch.ops.kvchat.q4_matmul(
            torch.randn(1, 64),
            layer.codes,
            layer.scales.to(torch.uint8),
            layer.offsets.to(torch.uint8),
        )


def test_the_kernel_reports_its_vector_path():
    isa = torch.ops.kvchat.quantized_matmul_isa()
    flags = native_build.cpu_flags()
    expected = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "portable"
    if native_build.target_arch() == "x86-64-v3":  # an AVX2-class CPU: AVX2 + FMA
        assert isa == "avx2"
    elif native_build.target_arch() != "native":
        assert isa in ("avx2", "portable")
    else:
        assert isa == expected
