"""A decoder layer's small ops: residual add + RMSNorm, rotary, SiLU(gate) * up, and
Gemma's forms of them (its (1 + w) norms rounded once, GELU(gate) * up).

Each has two implementations that compute the same numbers: kvchat's fused CPU kernels
(`kvchat/native/decoder_ops.cpp`), used once they are compiled and loaded, and plain
torch, used everywhere else (CUDA, other dtypes, no compiler, while the kernels
compile). Why both: at decode a layer's small ops are about forty torch calls on a few
hundred numbers each, where dispatch costs more than arithmetic; the kernels make them
four calls. The torch versions are the reference the tests hold the kernels to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.native import build

NATIVE_DTYPES = (torch.bfloat16, torch.float32)


def _native(x: torch.Tensor) -> bool:
    return build.loaded() and x.device.type == "cpu" and x.dtype in NATIVE_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [T, H]: float32 statistics, the scale applied in
    the input dtype."""
    if _native(x) and x.is_contiguous():
        return torch.ops.kvchat.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual connection and the norm after it.

    `delta` None means nothing to add (the first layer), and `h` is returned as it is.
    """
    if delta is None:
        return h, rms_norm(h, weight, eps)
    if _native(h) and h.is_contiguous() and delta.is_contiguous():
        return torch.ops.kvchat.add_rms_norm(h, delta, weight, eps)
    h = h + delta
    return h, rms_norm_reference(h, weight, eps)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> None:
    """Rotate, in place, the first `heads` heads of each row of x [T, W] by their
    position, in the half-split layout of transformers' rotate_half.

    cos and signed_sin are [T, D] (`RotaryTable.lookup`); signed_sin carries
    rotate_half's minus sign.
    """
    if _native(x) and x.stride(-1) == 1:
        torch.ops.kvchat.rotary_(x, cos, signed_sin, heads)
        return
    t, dim = x.shape[0], cos.shape[-1]
    part = x[:, : heads * dim].view(t, heads, dim)
    part.copy_(rotary_reference(part, cos.unsqueeze(1), signed_sin.unsqueeze(1)))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] holding gate then up: the MLP's middle."""
    if _native(gate_up) and gate_up.is_contiguous():
        return torch.ops.kvchat.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gemma_norm(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm over x's last dimension: statistics and the float32
    factor (1 + w) (`factor`) in float32, the result rounded to x's dtype once (the
    kernel takes rows [T, H]; other shapes, such as per-head views, run in torch)."""
    if _native(x) and x.dim() == 2 and x.is_contiguous():
        return torch.ops.kvchat.gemma_rms_norm(x, factor, eps)
    return gemma_norm_reference(x, factor, eps)


def gemma_heads_norm_(
    x: torch.Tensor, q_factor: torch.Tensor, k_factor: torch.Tensor, q_heads: int, k_heads: int,
    eps: float,
) -> None:  # fmt: skip
    """Gemma's q_norm and k_norm, in place on the fused projection's rows x [T, W]: the
    first `q_heads` heads with q_factor, the next `k_heads` with k_factor."""
    if _native(x) and x.stride(-1) == 1:
        torch.ops.kvchat.gemma_heads_norm_(x, q_factor, k_factor, q_heads, k_heads, eps)
        return
    t, dim = x.shape[0], q_factor.shape[0]
    q = x[:, : q_heads * dim].view(t, q_heads, dim)
    k = x[:, q_heads * dim : (q_heads + k_heads) * dim].view(t, k_heads, dim)
    q.copy_(gemma_norm_reference(q, q_factor, eps))
    k.copy_(gemma_norm_reference(k, k_factor, eps))


def gemma_add_norm(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor | None, pre: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + gemma_norm(y, post), gemma_norm of that with `pre`): a Gemma residual whose
    addend is normalized first (post None: added as it is), and the next norm."""
    if _native(h) and h.is_contiguous() and y.is_contiguous():
        return torch.ops.kvchat.gemma_add_rms_norm(h, y, post, pre, eps)
    h = h + (y if post is None else gemma_norm_reference(y, post, eps))
    return h, gemma_norm_reference(h, pre, eps)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh) * up for gate_up [T, 2I] holding gate then up: Gemma's MLP middle."""
    if _native(gate_up) and gate_up.is_contiguous():
        return torch.ops.kvchat.gelu_tanh_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gemma_norm_reference(x: torch.Tensor, factor: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch version, as transformers writes it."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * factor).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch version. The sum of squares comes from one `vector_norm` reduction in
    float32: on CPU `F.rms_norm` decomposes into more (and slower) ops than this."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [T, 1]
    inv = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    return weight * (x.float() * inv).to(x.dtype)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated: three ops (roll, mul, addcmul) instead of rotate_half's five;
    the result equals it up to rounding."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
