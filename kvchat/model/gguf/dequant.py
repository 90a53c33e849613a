"""Turning GGUF tensor bytes into float32 torch tensors (and 4-bit blocks into codes).

llama.cpp stores most weights in blocks: a run of 32 (or, for the K-quants,
256) values shares one or a few f16 scales, and the values themselves are
packed 4, 5, 6 or 8 bits wide. kvchat computes in bf16/fp32, so a GGUF model
is dequantized on load. Each format is decoded for all blocks at once with
tensor ops (one view of the bytes as `[n_blocks, bytes_per_block]`, then
slicing, shifting and masking), never a Python loop over blocks: the default
model has ~4 million blocks.

The arithmetic follows the order of ggml's reference `dequantize_row_*`
(and the `gguf` package's numpy port) so results match them bit for bit.

`unpack_q4` and `unpack_q8_0` expose the raw codes with their per-32 scales (and
offsets) for the paths that keep a GGUF's 4- and 8-bit weights as they are
(`quantized_linear.py`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvchat.errors import ModelLoadError
from kvchat.model.gguf.file import GGML_BLOCK_SIZES, GGMLType

QK = 32
"""Values per block of the legacy formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)."""
QK_K = 256
"""Values per super-block of the K-quants (Q2_K … Q6_K)."""
K_SCALE_SIZE = 12
"""Bytes of packed 6-bit scales and mins in a Q4_K/Q5_K super-block."""


def block_size(ggml_type: GGMLType) -> int:
    """Values per block of `ggml_type` (1 for plain float types)."""
    return GGML_BLOCK_SIZES[ggml_type][0]


def bytes_per_block(ggml_type: GGMLType) -> int:
    """Bytes one block of `ggml_type` takes in the file."""
    return GGML_BLOCK_SIZES[ggml_type][1]


def as_byte_tensor(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 torch view of `raw`, without copying.

    GGUF tensors come from a read-only memory map; torch warns that it cannot
    protect such memory from writes. Every function here only reads it, so
    the warning is silenced for this one conversion.
    """
    if isinstance(raw, torch.Tensor):
        return raw.reshape(-1).view(torch.uint8)
    array = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian f16 at byte `start` of each block, as float32: [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Split bytes [n, k*group] into 4-bit values [n, k, 2, group].

    Within each group of `group` bytes, the low nibbles come first, then the
    high ones: ggml's layout for every 4-bit format.
    """
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


def _bits(bytes_: torch.Tensor, width: int) -> torch.Tensor:
    """Unpack [..., m] bytes into [..., 8/width, m] fields of `width` bits, lowest first."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).reshape(-1, 1)
    return (bytes_.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)  # [n, 32]
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], QK // 2).reshape(n, QK).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:], QK // 2).reshape(n, QK).to(torch.float32)
    return d * q + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 high bits of a Q5_0/Q5_1 block: [n, 4] bytes -> [n, 32], bit j for value j."""
    n = qh.shape[0]
    return _bits(qh, 1).transpose(1, 2).reshape(n, QK)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    low = _nibbles(blocks[:, 6:], QK // 2).reshape(n, QK)
    q = (low | (_fifth_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    low = _nibbles(blocks[:, 8:], QK // 2).reshape(n, QK)
    q = (low | (_fifth_bits(blocks[:, 4:8]) << 4)).to(torch.float32)
    return d * q + m


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7;
    bytes 4-7 the same for mins; bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and mins 4-7 (high nibble).
    """
    n = scales.shape[0]
    d, m, m_d = scales.reshape(n, 3, 4).unbind(1)  # each [n, 4]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn  # [n, 8] each


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    scale = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 4 + K_SCALE_SIZE :], 32).reshape(n, 8, 32).to(torch.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])
    scale = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    offset = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    qh_start = 4 + K_SCALE_SIZE
    qh = _bits(blocks[:, qh_start : qh_start + 32], 1)  # [n, 8, 32]: bit i for sub-block i
    low = _nibbles(blocks[:, qh_start + 32 :], 32).reshape(n, 8, 32)
    q = (low | (qh << 4)).to(torch.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, : QK_K // 2]
    qh = blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales = blocks[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8)  # [n, 16]
    d = _f16(blocks, bytes_per_block(GGMLType.Q6_K) - 2)
    scale = (d * scales.to(torch.float32)).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)  # halves of 128 values, each 4 runs of 32
    high = _bits(qh.reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, 16).to(torch.float32)
    return (scale * q).reshape(n, QK_K)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, : QK_K // 16]  # [n, 16]: low nibble scale, high nibble min
    qs = blocks[:, QK_K // 16 : QK_K // 16 + QK_K // 4]
    d, dmin = _f16(blocks, QK_K // 16 + QK_K // 4), _f16(blocks, QK_K // 16 + QK_K // 4 + 2)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, QK_K // 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, QK_K // 16, 1)
    q = _bits(qs.reshape(n, 2, 32), 2)  # [n, 2, 4, 32]
    q = q.reshape(n, QK_K // 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask = blocks[:, : QK_K // 8]  # [n, 32]
    qs = blocks[:, QK_K // 8 : QK_K // 8 + QK_K // 4]  # [n, 64]
    packed = blocks[:, QK_K // 8 + QK_K // 4 : -2]  # [n, 12]
    d = _f16(blocks, bytes_per_block(GGMLType.Q3_K) - 2)
    low_sc = _bits(packed[:, :8], 4).reshape(n, 16)  # [n, 2, 8] -> [n, 16]
    high_sc = _bits(packed[:, 8:], 2).reshape(n, 16)  # [n, 4, 4] -> [n, 16]
    scales = ((low_sc | (high_sc << 4)).to(torch.int8) - 32).to(torch.float32)
    dl = (d * scales).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), 2).reshape(n, 16, 16)
    qh = _bits(hmask, 1).reshape(n, 16, 16) ^ 1  # a set bit means "no -4 offset"
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


# E2M1's sixteen values, doubled (ggml's kvalues_mxfp4): the scale below is halved to match
_MXFP4_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts: a block of 32 is one E8M0 exponent byte (a power of two, halved
    for the doubled values) and 16 bytes of 4-bit E2M1 codes, low nibbles first."""
    n = blocks.shape[0]
    exponent = blocks[:, :1].to(torch.int32)  # [n, 1]
    # ggml_e8m0_to_fp32_half: 2 ** (e - 128), exactly, subnormals included
    scale = torch.ldexp(torch.ones(n, 1), exponent - 128)
    codes = _nibbles(blocks[:, 1:], 16).reshape(n, QK).long()
    return _MXFP4_VALUES[codes] * scale


_BLOCK_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.MXFP4: _mxfp4,
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
}

_FLOAT_TYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: tuple[GGMLType, ...] = (*_FLOAT_TYPES, *_BLOCK_DECODERS)
"""The ggml types `dequantize` reads."""


def _check_size(raw: torch.Tensor, ggml_type: GGMLType, shape: Sequence[int]) -> int:
    """Validate that `raw` holds exactly `shape` in `ggml_type`; return the block count."""
    n_elements = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    block, type_size = GGML_BLOCK_SIZES[ggml_type]
    if len(shape) and shape[-1] % block:
        raise ModelLoadError(
            f"a {ggml_type.name} tensor's rows must be a multiple of {block} values; "
            f"shape {tuple(shape)} is not. The GGUF file is corrupt."
        )
    n_blocks = n_elements // block
    if raw.numel() != n_blocks * type_size:
        raise ModelLoadError(
            f"a {ggml_type.name} tensor of shape {tuple(shape)} needs {n_blocks * type_size:,} "
            f"bytes, got {raw.numel():,}. The GGUF file is corrupt."
        )
    return n_blocks


def _unsupported(ggml_type: int) -> ModelLoadError:
    name = GGMLType(ggml_type).name if ggml_type in GGMLType._value2member_map_ else ggml_type
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    return ModelLoadError(
        f"kvchat cannot dequantize GGUF tensors of type {name}; it reads {supported}. "
        "Use a GGUF quantized with one of those (e.g. Q4_K_M, Q8_0 or F16)."
    )


def dequantize(
    raw: np.ndarray | torch.Tensor, ggml_type: GGMLType | int, shape: Sequence[int]
) -> torch.Tensor:
    """Decode the bytes of one GGUF tensor into a new float32 tensor of `shape` (torch order).

    The result owns its memory (never a view of the file's read-only mapping),
    so callers may modify it.
    """
    if ggml_type not in _FLOAT_TYPES and ggml_type not in _BLOCK_DECODERS:
        raise _unsupported(ggml_type)
    ggml_type = GGMLType(ggml_type)
    data = as_byte_tensor(raw)
    n_blocks = _check_size(data, ggml_type, shape)
    float_dtype = _FLOAT_TYPES.get(ggml_type)
    if float_dtype is not None:
        values = data.view(float_dtype)
        # .to() of float32 to float32 would return the read-only view itself.
        out = values.clone() if float_dtype == torch.float32 else values.to(torch.float32)
    else:
        blocks = data.reshape(n_blocks, bytes_per_block(ggml_type))  # [n_blocks, type_size]
        out = _BLOCK_DECODERS[ggml_type](blocks)  # [n_blocks, block_size]
    return out.reshape(tuple(shape))


@dataclass(frozen=True)
class Int4Blocks:
    """A 4-bit weight as codes and per-32-column affine parameters.

    `weight[r, c] == codes[r, c] * scales[r, c // 32] + offsets[r, c // 32]`
    exactly (in float32), for Q4_0 (offset = -8 * d), Q4_1 (offset = m) and
    Q4_K (scale = d * sub-scale, offset = -dmin * sub-min). Q4_K's may stay as the
    file has them (`compact`): `scales` and `offsets` its 6-bit sub-scales and sub-mins
    (uint8), each times its 256 columns' `scale_supers` (d) and `offset_supers` (-dmin),
    float16 [rows, cols // 256]: 4.5 bits a weight streamed instead of 5.
    """

    codes: torch.Tensor  # [rows, cols] uint8 in 0..15
    scales: torch.Tensor  # [rows, cols // 32] float32 (uint8 when compact)
    offsets: torch.Tensor  # [rows, cols // 32] float32 (uint8 when compact)
    scale_supers: torch.Tensor | None = None  # [rows, cols // 256] float16, compact only
    offset_supers: torch.Tensor | None = None


def unpack_q4(
    raw: np.ndarray | torch.Tensor,
    ggml_type: GGMLType,
    shape: Sequence[int],
    *,
    compact: bool = False,
) -> Int4Blocks:
    """Split a Q4_0, Q4_1 or Q4_K matrix of `shape` [rows, cols] into `Int4Blocks`
    (a Q4_K one with its sub-scales as they are when `compact`)."""
    if ggml_type not in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K):
        raise ModelLoadError(
            f"unpack_q4 reads Q4_0, Q4_1 and Q4_K, not {GGMLType(ggml_type).name}."
        )
    if len(shape) != 2:
        raise ModelLoadError(f"unpack_q4 needs a 2-D weight, got shape {tuple(shape)}.")
    rows, cols = shape
    data = as_byte_tensor(raw)
    n_blocks = _check_size(data, ggml_type, shape)
    blocks = data.reshape(n_blocks, bytes_per_block(ggml_type))
    groups = cols // QK
    if ggml_type == GGMLType.Q4_K:
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)  # [n, 1]
        sc, mn = _k_scale_min(blocks[:, 4 : 4 + K_SCALE_SIZE])  # [n, 8]
        codes = _nibbles(blocks[:, 4 + K_SCALE_SIZE :], 32)  # [n, 4, 2, 32]
        if compact:
            return Int4Blocks(
                codes=codes.reshape(rows, cols),
                scales=sc.reshape(rows, groups),
                offsets=mn.reshape(rows, groups),
                scale_supers=d.half().reshape(rows, -1),
                offset_supers=(-dmin).half().reshape(rows, -1),
            )
        scales = d * sc.to(torch.float32)
        offsets = -(dmin * mn.to(torch.float32))
    else:
        d = _f16(blocks, 0)  # [n, 1]
        scales = d
        offsets = _f16(blocks, 2) if ggml_type == GGMLType.Q4_1 else d * -8.0
        codes = _nibbles(blocks[:, 4 if ggml_type == GGMLType.Q4_1 else 2 :], QK // 2)
    return Int4Blocks(
        codes=codes.reshape(rows, cols),
        scales=scales.reshape(rows, groups),
        offsets=offsets.reshape(rows, groups),
    )


@dataclass(frozen=True)
class Int8Blocks:
    """An 8-bit-or-narrower weight as signed codes and a scale per 32 or 16 columns:
    `weight[r, c] == codes[r, c] * scales[r, c // (cols // scales.shape[1])]` exactly
    (in float32), for Q8_0 (a scale per 32), Q5_0 (codes - 16, a scale per 32) and
    Q6_K (codes - 32, d * sub-scale per 16: no one scale per 32 holds two sub-blocks).
    Q6_K's may stay as the file has them (`compact`): `scales` its int8 sub-scales,
    each times its 256 columns' `scale_supers` (d, float16 [rows, cols // 256]), half a
    bit a weight where float32 scales per 16 took two."""

    codes: torch.Tensor  # [rows, cols] int8
    scales: torch.Tensor  # [rows, cols // 32 or cols // 16] float32 (int8 when compact)
    scale_supers: torch.Tensor | None = None  # [rows, cols // 256] float16, compact only

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]


EIGHT_BIT = (GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.Q5_0)
"""The types `unpack_int8` reads: those whose weights are a signed code times a scale."""


def unpack_int8(
    raw: np.ndarray | torch.Tensor,
    ggml_type: GGMLType,
    shape: Sequence[int],
    *,
    compact: bool = False,
) -> Int8Blocks:
    """Split a Q8_0, Q5_0 or Q6_K matrix of `shape` [rows, cols] into `Int8Blocks` (a
    Q6_K one with its sub-scales as they are when `compact`)."""
    if ggml_type not in EIGHT_BIT:
        raise ModelLoadError(
            f"unpack_int8 reads Q8_0, Q5_0 and Q6_K, not {GGMLType(ggml_type).name}."
        )
    if len(shape) != 2:
        raise ModelLoadError(f"unpack_int8 needs a 2-D weight, got shape {tuple(shape)}.")
    rows, cols = shape
    data = as_byte_tensor(raw)
    n_blocks = _check_size(data, ggml_type, shape)
    blocks = data.reshape(n_blocks, bytes_per_block(ggml_type))
    if ggml_type == GGMLType.Q8_0:
        codes = blocks[:, 2:].contiguous().view(torch.int8)
        scales = _f16(blocks, 0)
    elif ggml_type == GGMLType.Q5_0:
        low = _nibbles(blocks[:, 6:], QK // 2).reshape(n_blocks, QK)
        codes = (low | (_fifth_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
        scales = _f16(blocks, 0)
    else:
        ql = blocks[:, : QK_K // 2]
        qh = blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
        sub = blocks[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8)  # [n, 16]
        d = _f16(blocks, bytes_per_block(GGMLType.Q6_K) - 2)  # [n, 1]
        low = _nibbles(ql, 64).reshape(n_blocks, 8, 32)
        high = _bits(qh.reshape(n_blocks, 2, 32), 2).reshape(n_blocks, 8, 32)
        codes = (low | (high << 4)).to(torch.int8) - 32
        if compact:
            return Int8Blocks(
                codes=codes.reshape(rows, cols),
                scales=sub.reshape(rows, -1),
                scale_supers=d.half().reshape(rows, -1),
            )
        scales = d * sub.to(torch.float32)
    return Int8Blocks(codes=codes.reshape(rows, cols), scales=scales.reshape(rows, -1))
