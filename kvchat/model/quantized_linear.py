"""Weight-only quantized linear layers: a GGUF's blocks as they are, and `--quantize`'s.

Decode at batch 1 is bound by streaming the weights from memory, so fewer bytes a
weight is more tokens a second. A GGUF's matrices keep their blocks (`Q4Linear`: 4-bit
codes with a scale and an offset per 32; `Q8Linear`: int8 codes with a scale per 32 or
16) and are multiplied by kvchat's own kernel (`kvchat/native/quantized_matmul.cpp`),
which computes the file's exact weights in float32, bf16 activations widened: torch's
int kernels run a reference loop in float32 (every CPU without native bf16), and in
bf16 they were slower on a decode step (docs/kernels.md).

`--quantize` on a Hugging Face folder uses torch's CPU kernels, `_weight_int4pack_mm_for_cpu`
(`Int4Linear`: groups of 32, a scale and a zero per group; tinygemm dequantizes
`w = (q - 8) * scale + zero`) and `_weight_int8pack_mm` (`Int8Linear`: a scale per
output channel).

Large batches (prefill) are compute-bound, where the quantized kernels are slower than
a dense matmul; a layer may keep a dense copy (`dense`) for batches of
`dense_from_rows` rows or more, trading memory for prefill speed (the README says
how much). Each kind's threshold is measured (docs/kernels.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.model.linear import (
    DenseLinear,
    Linear,
    StackedLinear,
    pack_weight,
    packable,
    packed_linear,
)
from kvchat.native import build as native_build

GROUP_SIZE = 32
INNER_K_TILES = 2
# Rows from which a dense copy (when kept) beats the int4 kernel, and the same for a
# oneDNN-packed copy (measured: docs/kernels.md).
DENSE_FROM_TOKENS = 16
PACKED_FROM_TOKENS = 10


def int4_supported(device: torch.device, in_features: int, out_features: int) -> bool:
    """torch's int4 CPU kernel: CPU only, K a multiple of the group, N a multiple of 16.

    On CUDA kvchat falls back to dense (dequantized) weights: correct everywhere, and
    a GPU has the bandwidth that makes 4-bit streaming matter less.
    """
    return (
        device.type == "cpu"
        and hasattr(torch, "_weight_int4pack_mm_for_cpu")
        and in_features % GROUP_SIZE == 0
        and out_features % 16 == 0
    )


class _WeightOnlyLinear:
    """What the int4 and int8 layers share: an optional bias, an optional dense copy used
    for batches of `DENSE_FROM_TOKENS` rows or more, and (de)serialization of their
    tensors for the prepared-weights cache. Subclasses name their own tensors in
    `_TENSORS` and implement `_matmul` and `_set_shape`."""

    __slots__ = ("bias", "dense", "dense_packed", "in_features", "out_features")
    _TENSORS: tuple[str, ...] = ()
    _OPTIONAL: tuple[str, ...] = ()  # tensors a layer may lack (None), streamed when present
    dense_from_rows = DENSE_FROM_TOKENS

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _set_shape(self) -> None:
        raise NotImplementedError

    def _set_extras(self, bias: torch.Tensor | None, dense: torch.Tensor | None) -> None:
        self.bias = bias
        self.dense = dense
        self.dense_packed: torch.Tensor | None = None  # set by `prepack`

    def prepack(self) -> None:
        """Pack the dense copy for oneDNN where that applies (see `linear.py`); it then
        replaces the plain copy, so `state()` is for before this (the loader caches first)."""
        if self.dense is not None:
            self.dense_packed = pack_weight(self.dense)
            if self.dense_packed is not None:
                self.dense = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.dense_packed is not None and rows >= PACKED_FROM_TOKENS:
            return packed_linear(x, self.dense_packed, self.bias)
        if self.dense is not None and rows >= self.dense_from_rows:
            return F.linear(x, self.dense, self.bias)
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def packed_from_rows(self) -> int | None:
        packs = self.dense_packed is not None or packable(self.dense)
        return PACKED_FROM_TOKENS if packs else None

    def nbytes(self) -> int:
        tensors = (getattr(self, name) for name in (*self._TENSORS, *self._OPTIONAL))
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def state(self) -> dict[str, torch.Tensor]:
        out = {name: getattr(self, name) for name in self._TENSORS}
        for name in (*self._OPTIONAL, "bias", "dense"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]):
        """Rebuild from `state()` (the prepared-weights cache) without quantizing again."""
        self = cls.__new__(cls)
        for name in cls._TENSORS:
            setattr(self, name, state[name])
        for name in cls._OPTIONAL:
            setattr(self, name, state.get(name))
        self._set_extras(state.get("bias"), state.get("dense"))
        self._set_shape()
        return self


class Int4Linear(_WeightOnlyLinear):
    """W [N, K] as 4-bit codes with a bf16/fp32 scale and zero per group of 32 columns."""

    __slots__ = ("packed", "scale_zeros")
    _TENSORS = ("packed", "scale_zeros")

    def __init__(
        self,
        codes: torch.Tensor,  # [N, K] integers in 0..15
        scales: torch.Tensor,  # [N, K / 32]
        offsets: torch.Tensor,  # [N, K / 32]: w = code * scale + offset
        dtype: torch.dtype,
        *,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
    ):
        self.out_features, self.in_features = codes.shape
        self.packed = torch._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), INNER_K_TILES
        )
        zeros = offsets + 8.0 * scales
        self.scale_zeros = (
            torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        )  # [K / 32, N, 2]
        self._set_extras(bias, dense)

    def _set_shape(self) -> None:
        self.out_features = self.scale_zeros.shape[1]
        self.in_features = self.scale_zeros.shape[0] * GROUP_SIZE

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scale_zeros)

    def dequantized(self) -> torch.Tensor:
        """The float weight this layer multiplies by (for tests and fallbacks)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scale_zeros).t()

    @classmethod
    def fused(
        cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype, **kw
    ) -> Int4Linear:
        """Several projections of the same input stacked by rows into one weight."""
        codes, scales, offsets = (torch.cat([p[i] for p in parts], dim=0) for i in range(3))
        return cls(codes, scales, offsets, dtype, **kw)


class Int8Linear(_WeightOnlyLinear):
    """W [N, K] as int8 with one scale per output channel (round to nearest)."""

    __slots__ = ("q", "scales")
    _TENSORS = ("q", "scales")

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, *, bias=None, dense=None):
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        self.q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(dtype)
        self._set_extras(bias, dense)

    def _set_shape(self) -> None:
        self.out_features, self.in_features = self.q.shape

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scales.to(x.dtype))


def quantize_int4_rtn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric round-to-nearest: (codes, scales, offsets) for `Int4Linear`."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)  # [N, K/32]
    codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scales, lo


def compact_scales(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as float16 when every value survives the conversion exactly (a GGUF's
    legacy blocks store f16 scales), else as float32: half the bytes per group the
    kernel streams, and never a rounding."""
    floats = [t.float().contiguous() for t in tensors]
    halves = [t.half() for t in floats]
    if all(torch.equal(h.float(), f) for h, f in zip(halves, floats, strict=True)):
        return tuple(halves)
    return tuple(floats)


class _KernelLinear(_WeightOnlyLinear):
    """A layer multiplied by kvchat's quantized kernel, which computes the file's exact
    weights in float32 (bf16 activations are widened, the result narrowed back). Without
    a dense copy (float32) it takes every row count: the kernel itself takes prefill
    batches through tiles of dequantized rows, so the weight stays 4-bit or 8-bit in
    memory. With one (bf16), batches of `dense_from_rows` rows or more use the copy, as
    `Int4Linear` does. Only until the kernels are loaded (they compile once per machine,
    in the background) does a dequantized `fallback` serve; it is dropped as soon as they
    are."""

    __slots__ = ("fallback",)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def _set_extras(self, bias: torch.Tensor | None, dense: torch.Tensor | None) -> None:
        super()._set_extras(bias, dense)
        self.fallback: torch.Tensor | None = None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if native_build.loaded() and x.device.type == "cpu":
            self.fallback = None
            return self._kernel(x.contiguous())
        if self.dense_packed is not None:
            return packed_linear(x, self.dense_packed, None)
        if self.dense is not None and self.dense.dtype == x.dtype:
            return F.linear(x, self.dense)
        if self.fallback is None or self.fallback.dtype != x.dtype:
            self.fallback = self.dequantized().to(x.dtype)
        return F.linear(x, self.fallback)


def expanded(values: torch.Tensor, supers: torch.Tensor | None) -> torch.Tensor:
    """Scales (or offsets) as float32 values: integer sub-scales times their 256 columns'
    super-scale where they come as a K-quant stores them, else as they are."""
    if supers is None:
        return values.float()
    per_super = values.shape[1] // supers.shape[1]
    return values.float() * supers.float().repeat_interleave(per_super, dim=1)


class Q4Linear(_KernelLinear):
    """W [N, K] as 4-bit codes with a scale and an offset per group of 32 columns
    (`w = code * scale + offset`), in the kernel's layout: a group is 16 bytes, byte j
    holding element j in its low nibble and element j + 16 in its high one. A Q4_K
    matrix may keep its 6-bit sub-scales and sub-mins with their float16 super-scales
    (`scale_supers`, `offset_supers`: see `Int4Blocks`)."""

    __slots__ = ("codes", "offset_supers", "offsets", "scale_supers", "scales")
    _TENSORS = ("codes", "scales", "offsets")
    _OPTIONAL = ("scale_supers", "offset_supers")

    def __init__(
        self,
        codes: torch.Tensor,  # [N, K] integers in 0..15
        scales: torch.Tensor,  # [N, K / 32]
        offsets: torch.Tensor,  # [N, K / 32]
        scale_supers: torch.Tensor | None = None,  # [N, K / 256] with integer scales
        offset_supers: torch.Tensor | None = None,
        *,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
    ):
        n, k = codes.shape
        halves = codes.to(torch.uint8).reshape(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
        self.codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        if scale_supers is None:
            self.scales, self.offsets = compact_scales(scales, offsets)
            self.scale_supers = self.offset_supers = None
        else:
            self.scales = scales.to(torch.uint8).contiguous()
            self.offsets = offsets.to(torch.uint8).contiguous()
            self.scale_supers = scale_supers.half().contiguous()
            self.offset_supers = offset_supers.half().contiguous()
        self._set_extras(bias, dense)
        self._set_shape()

    def _set_shape(self) -> None:
        self.out_features = self.codes.shape[0]
        self.in_features = self.codes.shape[1] * 2

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvchat.q4_matmul(
            x, self.codes, self.scales, self.offsets, self.scale_supers, self.offset_supers
        )

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (for tests and fallbacks)."""
        n, k = self.out_features, self.in_features
        groups = self.codes.reshape(n, k // GROUP_SIZE, 1, GROUP_SIZE // 2)
        codes = torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(n, k // GROUP_SIZE, -1)
        scales = expanded(self.scales, self.scale_supers)
        offsets = expanded(self.offsets, self.offset_supers)
        w = codes.float() * scales[..., None] + offsets[..., None]
        return w.reshape(n, k)

    @classmethod
    def fused(cls, parts: list[tuple[torch.Tensor, ...]], **kw) -> Q4Linear:
        """Several projections of the same input stacked by rows into one weight (parts
        all with super-scales, or all without)."""
        return cls(*(torch.cat([p[i] for p in parts], dim=0) for i in range(len(parts[0]))), **kw)


class Q8Linear(_KernelLinear):
    """W [N, K] as int8 codes with a scale per 32 columns (GGUF's Q8_0 and Q5_0) or per
    16 (Q6_K's sub-blocks, d * sub-scale, or its int8 sub-scales with d as `scale_supers`),
    so such a matrix is computed exactly at 8 bits a weight (plus its scales) instead of
    a dense copy's 16 or 32."""

    __slots__ = ("codes", "scale_supers", "scales", "small_codes")
    _TENSORS = ("codes", "scales")
    _OPTIONAL = ("scale_supers",)

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        scale_supers: torch.Tensor | None = None,
        *,
        bias=None,
        dense=None,
    ):
        self.codes = codes.to(torch.int8).contiguous().view(torch.uint8)  # the kernel's type
        if scale_supers is None:
            (self.scales,) = compact_scales(scales)
            self.scale_supers = None
        else:
            self.scales = scales.to(torch.int8).contiguous()
            self.scale_supers = scale_supers.half().contiguous()
        self._set_extras(bias, dense)
        self._set_shape()

    def _set_shape(self) -> None:
        self.out_features, self.in_features = self.codes.shape
        # Q6_K's and Q5_0's codes fit in 6 bits, which bf16 rows multiply as bf16 numbers
        low, high = torch.aminmax(self.codes.view(torch.int8))
        self.small_codes = bool(low >= -32 and high <= 31)

    def _kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvchat.q8_matmul(
            x, self.codes, self.scales, self.scale_supers, self.small_codes
        )

    def dequantized(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the float32 weight: a tied head's codes serve as the embedding
        table too, so the table is never dequantized whole (a Gemma's 262,144 rows are
        320 MiB in bf16, more than the whole 4-bit file)."""
        groups = self.scales.shape[1]
        codes = self.codes[ids].view(torch.int8).float()
        codes = codes.reshape(len(ids), groups, self.in_features // groups)
        supers = None if self.scale_supers is None else self.scale_supers[ids]
        scales = expanded(self.scales[ids], supers)
        return (codes * scales[..., None]).reshape(len(ids), self.in_features)

    @classmethod
    def fused(cls, parts: list[tuple[torch.Tensor, ...]], **kw) -> Q8Linear:
        """Several projections of the same input stacked by rows (their scales per as
        many columns, all with super-scales or all without)."""
        return cls(*(torch.cat([p[i] for p in parts], dim=0) for i in range(len(parts[0]))), **kw)


# "dense": a dense part of a `StackedLinear`
_KINDS = {
    "int4": Int4Linear,
    "int8": Int8Linear,
    "q4": Q4Linear,
    "q8": Q8Linear,
    "dense": DenseLinear,
}
_PART = "#"  # a stacked layer's parts are saved as "{name}#{index}"


def save_linears(path, linears: dict[str, Linear]) -> None:
    """Cache prepared quantized layers (packing is slow; loading a file is not)."""
    import json

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, linear in linears.items():
        parts = linear.parts if isinstance(linear, StackedLinear) else [linear]
        for index, part in enumerate(parts):
            key = f"{name}{_PART}{index}" if isinstance(linear, StackedLinear) else name
            kinds[key] = next(kind for kind, cls in _KINDS.items() if type(part) is cls)
            for field, t in part.state().items():
                tensors[f"{key}::{field}"] = t.contiguous()
    partial = path.with_suffix(".partial")
    try:
        save_file(tensors, str(partial), metadata={"kinds": json.dumps(kinds)})
    except BaseException:  # a full disk: no half-written file left behind
        partial.unlink(missing_ok=True)
        raise
    partial.replace(path)


def load_linears(path) -> dict[str, Linear]:
    """Load `save_linears`' file. Every tensor is cloned into a fresh allocation: tensors
    read from a safetensors file may sit at unaligned addresses, and torch's int8 kernel
    crashes (SIGSEGV, seen with M >= 32) on an unaligned weight."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
        states: dict[str, dict[str, torch.Tensor]] = {n: {} for n in kinds}
        for key in f.keys():  # noqa: SIM118 - safe_open is not a dict
            name, _, field = key.partition("::")
            states[name][field] = f.get_tensor(key).clone()
    out: dict[str, Linear] = {}
    stacks: dict[str, dict[int, Linear]] = {}
    for key, kind in kinds.items():
        linear = _KINDS[kind].from_state(states[key])
        name, part, index = key.partition(_PART)
        if part:
            stacks.setdefault(name, {})[int(index)] = linear
        else:
            out[name] = linear
    for name, parts in stacks.items():
        out[name] = StackedLinear([parts[i] for i in sorted(parts)])
    return out
