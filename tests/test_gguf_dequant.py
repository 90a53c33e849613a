"""GGUF dequantization against the `gguf` package's numpy reference (a test-only dependency)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as reference_dequantize  # noqa: E402

from kvchat.errors import ModelLoadError  # noqa: E402
from kvchat.model.gguf.dequant import (  # noqa: E402
    SUPPORTED_TYPES,
    block_size,
    bytes_per_block,
    dequantize,
    unpack_q4,
)
from kvchat.model.gguf.file import GGMLType  # noqa: E402

# Byte offsets of the f16 scale fields inside one block of each format. Random
# bytes there could be NaN/inf; every other byte of a block is a valid code.
F16_FIELDS = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
    GGMLType.MXFP4: (),  # its scale is a power-of-two byte: every value is a valid one
}


def random_tensor_bytes(ggml_type: GGMLType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid random bytes of a [rows, cols] tensor of `ggml_type`."""
    rng = np.random.default_rng(seed)
    n = rows * cols
    if ggml_type == GGMLType.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        top = rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
        return top.astype(np.uint16).view(np.uint8)
    n_blocks = n // block_size(ggml_type)
    blocks = rng.integers(0, 256, size=(n_blocks, bytes_per_block(ggml_type)), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        scales = rng.uniform(-2.0, 2.0, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(-1)


def test_every_format_kvchat_claims_has_a_test_generator() -> None:
    assert set(SUPPORTED_TYPES) == set(F16_FIELDS) | {GGMLType.F32, GGMLType.F16, GGMLType.BF16}


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bit_for_bit(ggml_type: GGMLType) -> None:
    rows, cols = 5, 2 * max(block_size(ggml_type), 32)
    raw = random_tensor_bytes(ggml_type, rows, cols)
    expected = reference_dequantize(
        raw.reshape(rows, -1), gguf.GGMLQuantizationType(int(ggml_type))
    )

    got = dequantize(raw, ggml_type, (rows, cols))

    assert got.dtype == torch.float32
    assert got.shape == (rows, cols)
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_dequantize_keeps_rows_apart_in_3d_shapes(ggml_type: GGMLType) -> None:
    shape = (2, 3, block_size(ggml_type))
    raw = random_tensor_bytes(ggml_type, 6, shape[-1], seed=1)
    flat = reference_dequantize(raw.reshape(6, -1), gguf.GGMLQuantizationType(int(ggml_type)))

    got = dequantize(torch.from_numpy(raw.copy()), ggml_type, shape)

    assert got.shape == shape
    np.testing.assert_array_equal(got.reshape(6, -1).numpy(), flat)


def test_dequantize_of_quantized_values_recovers_them() -> None:
    """Round trip through the reference quantizer: Q8_0 of random weights is within 1% of them."""
    weights = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0).reshape(-1)

    got = dequantize(raw, GGMLType.Q8_0, weights.shape).numpy()

    np.testing.assert_allclose(got, weights, atol=0.01 * np.abs(weights).max())


def test_float32_result_does_not_alias_the_read_only_input() -> None:
    raw = np.arange(8, dtype=np.float32).view(np.uint8)
    raw.flags.writeable = False

    got = dequantize(raw, GGMLType.F32, (8,))
    got += 1  # would crash or corrupt if it were a view of a read-only mapping

    assert raw.view(np.float32)[0] == 0.0


def test_unsupported_type_error_names_it_and_lists_supported_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"IQ2_XXS.*Q4_K"):
        dequantize(np.zeros(66, dtype=np.uint8), GGMLType.IQ2_XXS, (256,))


def test_wrong_byte_count_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="needs 68 bytes, got 35"):
        dequantize(np.zeros(35, dtype=np.uint8), GGMLType.Q8_0, (2, 32))


def test_row_length_not_a_multiple_of_the_block_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        dequantize(np.zeros(36, dtype=np.uint8), GGMLType.Q4_0, (3, 16))


@pytest.mark.parametrize(
    "ggml_type", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K], ids=lambda t: t.name
)
def test_unpack_q4_codes_scales_offsets_rebuild_the_dequantized_weight(ggml_type: GGMLType) -> None:
    rows, cols = 3, 512
    raw = random_tensor_bytes(ggml_type, rows, cols, seed=3)

    parts = unpack_q4(raw, ggml_type, (rows, cols))

    assert parts.codes.dtype == torch.uint8 and parts.codes.shape == (rows, cols)
    assert int(parts.codes.max()) <= 15
    assert parts.scales.shape == parts.offsets.shape == (rows, cols // 32)
    rebuilt = parts.codes.float() * parts.scales.repeat_interleave(32, dim=1)
    rebuilt = rebuilt + parts.offsets.repeat_interleave(32, dim=1)
    torch.testing.assert_close(rebuilt, dequantize(raw, ggml_type, (rows, cols)), rtol=0, atol=0)


@pytest.mark.parametrize("compact", [False, True], ids=["float32", "compact"])
@pytest.mark.parametrize(
    "ggml_type",
    [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q6_K],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize("head_dim", [128, 16])
def test_value_heads_reordered_on_a_matrixs_blocks_are_its_columns_in_that_order(
    ggml_type: GGMLType, compact: bool, head_dim: int
) -> None:
    """Qwen3.5's out_proj columns put back in grouped order on the blocks (K-quants'
    super-scales multiplied out first): the layer's weight is the dequantized matrix's
    columns in that order exactly; a head narrower than a scale group is refused."""
    from kvchat.model.gguf.convert import grouped_order
    from kvchat.model.gguf.weights import columns_in_order, kernel_linear, unpacked

    rows, cols = 3, 512
    raw = random_tensor_bytes(ggml_type, rows, cols, seed=5)
    order = grouped_order(2, cols // head_dim, head_dim)  # 2 key heads, 4 or 32 value heads
    _, blocks = unpacked(raw, ggml_type, (rows, cols), compact)
    moved = columns_in_order(blocks, order)
    group = 16 if ggml_type == GGMLType.Q6_K else 32
    assert (moved is None) == (head_dim % group != 0)
    if moved is not None:
        want = dequantize(raw, ggml_type, (rows, cols))[:, order]
        got = kernel_linear([moved]).dequantized()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
