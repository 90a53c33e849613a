"""Reading a GGUF file: its header, metadata, tensor table and tensor bytes.

GGUF is llama.cpp's single-file model format: a header, key/value metadata
(hyper-parameters, the tokenizer, the chat template), a table of tensor
descriptions, then the tensor data, aligned. This module owns the byte layout
only; what the metadata and the tensors mean for kvchat lives in
`convert.py`, `tokenizer.py` and `dequant.py` beside it.

We read it ourselves (numpy memmap + `struct`) rather than through the `gguf`
package so that the app does not depend on it at run time, and so that every
way a file can be broken ends in a `ModelLoadError` that tells the user what is
wrong instead of an `IndexError` deep in a parser. The file is memory-mapped:
`raw()` hands out zero-copy views, so opening a multi-gigabyte model costs
nothing until its tensors are read.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from kvchat.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32


class GGMLType(IntEnum):
    """Tensor element types, numbered as in llama.cpp's `ggml_type`."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


_QK_K = 256

# (elements per block, bytes per block), as llama.cpp's `ggml_type_traits`.
# Needed here, not only in the dequantizer, because a tensor's byte size (and
# so whether the file is truncated) follows from its type.
GGML_BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (_QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    GGMLType.Q3_K: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    GGMLType.Q4_K: (_QK_K, 2 + 2 + _QK_K // 2 + 12),
    GGMLType.Q5_K: (_QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 12),
    GGMLType.Q6_K: (_QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16),
    GGMLType.Q8_K: (_QK_K, 4 + _QK_K + _QK_K // 8),
    GGMLType.IQ2_XXS: (_QK_K, 2 + _QK_K // 4),
    GGMLType.IQ2_XS: (_QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    GGMLType.IQ3_XXS: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    GGMLType.IQ1_S: (_QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (_QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    GGMLType.IQ2_S: (_QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    GGMLType.IQ4_XS: (_QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (_QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (_QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: (_QK_K, 2 + 64),
    GGMLType.MXFP4: (32, 1 + 16),
}


class GGUFValueType(IntEnum):
    """Metadata value types of the GGUF format."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format (little-endian) of each fixed-size scalar value type.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

# numpy dtype of the same types, for reading numeric arrays in one go.
_NUMPY_DTYPES: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    `shape` is in torch order (outermost first): GGUF lists dimensions
    innermost first, so a `[out, in]` linear weight is stored as `[in, out]`.
    `offset` is absolute in the file, so `raw()` needs nothing else.
    """

    name: str
    ggml_type: GGMLType
    shape: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        """How many scalar values the tensor holds."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Truncated(Exception):
    """Internal: a read ran past the end of the file."""


class _Cursor:
    """Sequential little-endian reads over the mapped bytes, bounds-checked."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.pos = 0
        self.size = len(data)

    def take(self, n: int) -> np.ndarray:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated
        view = self.data[self.pos : self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> int | float | bool:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Truncated
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return value

    def u32(self) -> int:
        return int(self.scalar("<I"))

    def u64(self) -> int:
        return int(self.scalar("<Q"))

    def string(self) -> str:
        n = self.u64()
        return self.take(n).tobytes().decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)  # type: ignore[call-overload]
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(fmt)

    def array(self) -> list[object]:
        item_type = self.u32()
        count = self.u64()
        if item_type == GGUFValueType.STRING:
            return [self.string() for _ in range(count)]
        if item_type == GGUFValueType.ARRAY:
            return [self.array() for _ in range(count)]
        dtype = _NUMPY_DTYPES.get(item_type)  # type: ignore[call-overload]
        if dtype is None:
            raise ValueError(f"unknown metadata array item type {item_type}")
        np_dtype = np.dtype(dtype)
        if count > self.size:  # cheap guard before multiplying a garbage count
            raise _Truncated
        values = np.frombuffer(self.take(count * np_dtype.itemsize).tobytes(), dtype=np_dtype)
        if item_type == GGUFValueType.BOOL:
            return [bool(v) for v in values]
        return values.tolist()


class GGUFFile:
    """An open, memory-mapped GGUF file: metadata, tensor table, tensor bytes."""

    def __init__(
        self,
        path: Path,
        data: np.ndarray,
        version: int,
        metadata: dict[str, object],
        tensors: dict[str, GGUFTensorInfo],
        alignment: int,
        data_offset: int,
    ) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset
        self._data = data

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        """Map `path` and parse everything but the tensor data itself.

        Raises `ModelLoadError` when the file is missing, is not a GGUF, is
        of a version we do not read, or is shorter than its own header says
        (a download cut short is the usual cause).
        """
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ModelLoadError(
                f"cannot read the GGUF file {path}: {exc.strerror or exc}"
            ) from exc
        if size < 8:
            raise _not_gguf(path) if size < 4 or _peek(path, 4) != GGUF_MAGIC else _truncated(path)
        try:
            data = np.memmap(path, dtype=np.uint8, mode="r")
        except OSError as exc:
            raise ModelLoadError(f"cannot map the GGUF file {path}: {exc}") from exc

        cursor = _Cursor(data)
        try:
            if cursor.take(4).tobytes() != GGUF_MAGIC:
                raise _not_gguf(path)
            version = cursor.u32()
            if version not in SUPPORTED_VERSIONS:
                raise _bad_version(path, version)
            n_tensors = cursor.u64()
            n_kv = cursor.u64()
            metadata: dict[str, object] = {}
            for _ in range(n_kv):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.u32())
            infos = [_read_tensor_info(cursor, path) for _ in range(n_tensors)]
        except _Truncated:
            raise _truncated(path) from None
        except ValueError as exc:
            raise ModelLoadError(f"{path} is a corrupt GGUF file: {exc}.") from exc

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(
                f"{path} is a corrupt GGUF file: general.alignment is {alignment!r}, "
                "not a power of two."
            )
        data_offset = -(-cursor.pos // alignment) * alignment

        tensors: dict[str, GGUFTensorInfo] = {}
        for name, ggml_type, shape, rel_offset, n_bytes in infos:
            end = data_offset + rel_offset + n_bytes
            if end > size:
                raise ModelLoadError(
                    f"{path} is truncated: tensor {name!r} ends at byte {end:,} but the file "
                    f"has {size:,} bytes. Download the model again."
                )
            tensors[name] = GGUFTensorInfo(
                name=name,
                ggml_type=ggml_type,
                shape=shape,
                offset=data_offset + rel_offset,
                n_bytes=n_bytes,
            )
        return cls(path, data, version, metadata, tensors, alignment, data_offset)

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor `name`: a read-only uint8 view of the mapping, no copy."""
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path.name} has no tensor {name!r}")
        return self._data[info.offset : info.offset + info.n_bytes]

    @property
    def architecture(self) -> str | None:
        """`general.architecture`, e.g. "llama"; None when the file does not say."""
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def close(self) -> None:
        """Drop our reference to the mapping; views already handed out keep it alive."""
        self._data = np.empty(0, dtype=np.uint8)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


def _read_tensor_info(
    cursor: _Cursor, path: Path
) -> tuple[str, GGMLType, tuple[int, ...], int, int]:
    name = cursor.string()
    n_dims = cursor.u32()
    if n_dims > 8:
        raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cursor.u64() for _ in range(n_dims)]
    type_id = cursor.u32()
    rel_offset = cursor.u64()
    try:
        ggml_type = GGMLType(type_id)
    except ValueError:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has ggml type {type_id}, which kvchat does not know. "
            "Use a GGUF quantized as F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or a K-quant."
        ) from None
    block, type_size = GGML_BLOCK_SIZES[ggml_type]
    # Python integers: a garbage shape must not wrap around 64 bits into a small size
    n_elements = math.prod(dims)
    if dims and dims[0] % block:
        raise ValueError(
            f"tensor {name!r} has {dims[0]} columns, not a multiple of its "
            f"{ggml_type.name} block size {block}"
        )
    shape = tuple(reversed(dims))  # GGUF lists the innermost dimension first
    return name, ggml_type, shape, rel_offset, n_elements // block * type_size


def _peek(path: Path, n: int) -> bytes:
    with path.open("rb") as f:
        return f.read(n)


def _not_gguf(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'). "
        "Pass a .gguf model file or a Hugging Face model directory."
    )


def _truncated(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is truncated: the file ends inside its GGUF header. Download the model again."
    )


def _bad_version(path: Path, version: int) -> ModelLoadError:
    if version & 0xFFFF == 0 and version >> 16:
        hint = "it looks big-endian, which kvchat does not read"
    elif version == 1:
        hint = "GGUF v1 predates August 2023; convert the model again with a current llama.cpp"
    else:
        hint = "convert the model again with a current llama.cpp"
    return ModelLoadError(
        f"{path} is GGUF version {version}; kvchat reads versions "
        f"{', '.join(map(str, SUPPORTED_VERSIONS))} ({hint})."
    )
