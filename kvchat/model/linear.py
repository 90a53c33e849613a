"""The weight of one linear layer and how it multiplies: the seam for quantized weights.

The forward pass calls `linear(x)` and never looks inside. `DenseLinear` keeps the
weight in the compute dtype; quantized kinds (see `quantized_linear.py`) keep
4- or 8-bit codes and pick the fastest kernel for the batch at hand.

A bf16 weight on the CPU is multiplied fastest in oneDNN's blocked layout, packed
once when the model is built (`prepack`): `F.linear` re-lays the weight out at every
call. Packing gives identical results and no gain for float32, so only bf16 is packed
(measured: docs/kernels.md).

oneDNN builds a kernel for each row count it multiplies a packed weight by, and it and
torch's wrapper keep every one built (up to 1,024 each, up to a few MiB a kernel, and
building one costs more than a short product). Prefill steps come in ever new lengths,
so a packed product runs at one of a few row counts (`packed_rows`), and both caches are
capped at the kernels that every turn's steps use plus room for a few long prompts'
(`bounded_kernel_caches`): the process stops growing early (measured: docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        ...

    def nbytes(self) -> int:
        """Bytes this weight streams from memory per forward (the decode's cost)."""
        ...

    def prepack(self) -> None:
        """Lay the weight out for the fastest kernel, once, after loading (and caching)."""
        ...

    def packed_from_rows(self) -> int | None:
        """The fewest rows this layer multiplies with a oneDNN-packed weight, None if it
        never does; answered before `prepack` from whether its weight is packable."""
        ...


PACK_ROWS_HINT = 16  # oneDNN tunes the layout for this many rows; 16 and 128 measured alike
# Up to this many rows a packed product runs as it comes (decode batches: few counts,
# and a row more costs up to 10% there); above, at the next of 4 row counts an octave.
EXACT_ROWS = 8
# Steps of up to this many rows come at every turn (decodes, decodes beside a prefill
# chunk): their kernels are kept. Longer steps (a new prompt, a history recomputed)
# come now and then, at lengths that vary: the caches keep room for this many of their
# row counts, and rebuild the kernels of one that comes back after being evicted.
HOT_ROWS = 64
SPARE_ROW_COUNTS = 4
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@functools.cache
def onednn_bf16_packing() -> bool:
    """Whether torch's oneDNN packs and multiplies bf16 weights here, checked on a probe."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    want = F.linear(x.float(), w.float())
    return bool(torch.allclose(got.float(), want, atol=0.05, rtol=0.02))


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] in oneDNN's blocked layout, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not onednn_bf16_packing():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)


def packable(weight: torch.Tensor | None) -> bool:
    """Whether `pack_weight` would be asked to pack this weight (bf16 on a CPU)."""
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.bfloat16


def packed_rows(rows: int) -> int:
    """The row count a packed product of `rows` rows runs at: `rows` itself up to
    `EXACT_ROWS`, else rounded up to a multiple of 1/4 of its power of two (9 -> 10,
    17 -> 20, 100 -> 112, 1000 -> 1024): 4 counts an octave, at most 1/4 of the rows
    padding (1/12 on average), 36 counts from 9 to 4,096 rows. Up to 64 rows a
    product streams its weight more than it computes, so padding there costs little
    (measured: docs/kernels.md)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def kernel_cache_capacity(linears: Iterable[Linear]) -> int:
    """How many kernels oneDNN's caches should keep for these layers: one for each packed
    weight shape and row count up to `HOT_ROWS` it multiplies at, plus `SPARE_ROW_COUNTS`
    longer row counts for each shape."""
    hot: set[tuple[int, int, int]] = set()
    shapes: set[tuple[int, int]] = set()
    for linear in linears:
        first = linear.packed_from_rows()
        if first is None:
            continue
        shape = (linear.out_features, linear.in_features)
        shapes.add(shape)
        hot.update((*shape, packed_rows(rows)) for rows in range(first, HOT_ROWS + 1))
    return len(hot) + SPARE_ROW_COUNTS * len(shapes)


@contextlib.contextmanager
def bounded_kernel_caches(linears: Iterable[Linear]) -> Iterator[None]:
    """Pack inside this: oneDNN's primitive cache and torch's (ideep's) are then capped at
    `kernel_cache_capacity`.

    Both keep up to 1,024 kernels by default, least recently used out, so a long chat
    would hold a kernel for every long step's row count it ever met: tens to hundreds of
    MiB, growing for hours. Each reads its capacity from the environment once, when it
    first builds a kernel, which the first packing does (the probe in
    `onednn_bf16_packing`); in a process that built one before, this changes nothing. A
    capacity the user set is kept. The variables set here are taken out again on the way
    out, so that processes kvchat starts (a peer server in a benchmark) do not inherit a
    cap sized for this model.
    """
    capacity = kernel_cache_capacity(linears)
    ours = [name for name in KERNEL_CACHE_VARIABLES if name not in os.environ] if capacity else []
    for name in ours:
        os.environ[name] = str(capacity)
    try:
        yield
    finally:
        for name in ours:
            os.environ.pop(name, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] times a `pack_weight` result (+ bias): [T, out].

    Run at `packed_rows(T)` rows, zero rows appended, so that oneDNN reuses the kernels
    it built for earlier steps instead of building (and keeping) one for every new T.
    """
    rows = x.shape[0]
    padded = packed_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return y if padded == rows else y[:rows]


class DenseLinear:
    __slots__ = ("_nbytes", "bias", "in_features", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight: torch.Tensor | None = weight  # [out, in]; None once packed
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self._nbytes = weight.numel() * weight.element_size()

    def prepack(self) -> None:
        """Replace the weight by its packed form where that applies. Memory stays the same,
        except for a tied LM head: the embeddings keep the plain tensor, so the packed
        copy adds the head's size (57 MB for the default model in bf16)."""
        if self.packed is None and self.weight is not None:
            self.packed = pack_weight(self.weight)
            if self.packed is not None:
                self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        assert self.weight is not None
        if x.shape[0] == 1 and x.device.type == "cpu":
            # A single row (decode at batch 1): `mv` streams a bf16 weight faster than
            # `F.linear`'s GEMM path (measured: docs/kernels.md).
            y = torch.mv(self.weight, x[0]).unsqueeze(0)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return self._nbytes

    def packed_from_rows(self) -> int | None:
        return 1 if self.packed is not None or packable(self.weight) else None

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors to cache (before `prepack`): a dense part of a `StackedLinear`."""
        assert self.weight is not None, "cached before packing"
        return {"weight": self.weight} | ({} if self.bias is None else {"bias": self.bias})

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> DenseLinear:
        return cls(state["weight"], state.get("bias"))

    @classmethod
    def fused(
        cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None
    ) -> DenseLinear:
        """One matmul for several projections of the same input (q/k/v, gate/up)."""
        return cls(torch.cat(weights, dim=0), torch.cat(biases) if biases else None)


class StackedLinear:
    """Projections of one input kept in different formats, their outputs side by side:
    a Q4_K_M file keeps q and k 4-bit and v in Q6_K, and the model still sees one fused
    q/k/v layer, each part multiplied by its own format's kernel (a part may be dense: a
    Gated DeltaNet's small b and a beside its quantized q/k/v and z)."""

    __slots__ = ("in_features", "out_features", "parts")

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def prepack(self) -> None:
        for part in self.parts:
            part.prepack()

    def packed_from_rows(self) -> int | None:
        firsts = [f for f in (part.packed_from_rows() for part in self.parts) if f is not None]
        return min(firsts, default=None)


def make_linear(weights: list, biases: list | None = None) -> Linear:
    """A linear layer from one or several (fused) weights: dense tensors or already-built
    `Linear`s (quantized weights are built by the loader and passed through as they are)."""
    if len(weights) == 1 and not isinstance(weights[0], torch.Tensor):
        return weights[0]
    if len(weights) == 1:
        return DenseLinear(weights[0], biases[0] if biases else None)
    return DenseLinear.fused(weights, biases)


def slot_names(cls: type) -> list[str]:
    """The attribute names a `__slots__` class (and its bases) declare: where a `Linear`
    keeps its tensors."""
    return [name for c in cls.__mro__ for name in getattr(c, "__slots__", ())]
