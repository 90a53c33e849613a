"""The weight of one linear layer and how it multiplies: the seam for quantized weights.

The forward pass calls `linear(x)` and never looks inside. `DenseLinear` keeps the
weight in the compute dtype; quantized kinds (see `quantized_linear.py`) keep
4- or 8-bit codes and pick the fastest kernel for the batch at hand.

A bf16 weight on the CPU is multiplied fastest in oneDNN's blocked layout, packed
once when the model is built (`prepack`): `F.linear` re-lays the weight out at every
call. Packing gives identical results and no gain for float32, so only bf16 is packed
(measured: docs/kernels.md).

oneDNN builds a kernel for each row count it multiplies a packed weight by, and it and
torch's wrapper keep every one built (up to 1,024 each, about half a MiB a kernel, and
building one costs more than the product). Prefill steps come in ever new lengths, so a
packed product runs at one of a few row counts (`packed_rows`): the kernels built stay
few, and the process stops growing (measured: docs/reliability.md).
"""

from __future__ import annotations

import functools
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


PACK_ROWS_HINT = 16  # oneDNN tunes the layout for this many rows; 16 and 128 measured alike
# Up to this many rows a packed product runs as it comes (decode batches: few counts);
# above, at the next of 8 row counts an octave (at most 1/8 of the rows are padding).
EXACT_ROWS = 16


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


def packed_rows(rows: int) -> int:
    """The row count a packed product of `rows` rows runs at: `rows` itself up to
    `EXACT_ROWS`, else rounded up to a multiple of 1/8 of its power of two (17 -> 18,
    100 -> 104, 1000 -> 1024): 8 counts an octave, so at most 64 from 16 to 4,096 rows."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


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

    @classmethod
    def fused(
        cls, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None
    ) -> DenseLinear:
        """One matmul for several projections of the same input (q/k/v, gate/up)."""
        return cls(torch.cat(weights, dim=0), torch.cat(biases) if biases else None)
