"""Paged attention through kvchat's CPU kernel (`kvchat/native/paged_attention.cpp`).

Why a kernel of its own: on a CPU, torch's flash attention needs each sequence's K/V
as one strided tensor and gives each (sequence, kv head) pair to one thread, so a long
decode ran on one core per kv head and a paged context was copied before every layer.
The kernel reads K/V in place through the page lists and spreads even a single long
decode over every core. It is built and loaded by `kvchat.native.build`.
"""

from __future__ import annotations

import torch

from kvchat.native import build

HEAD_DIMS = (16, 64, 128, 256)  # head sizes the kernel is compiled for (16: the tests' tiny models)
DTYPES = (torch.bfloat16, torch.float32)


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the loaded kernel serves this model's attention."""
    return build.loaded() and device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def serves_chunks(dtype: torch.dtype, quantized_kv: bool) -> bool:
    """Whether prefill chunks, not only decodes, are faster through the kernel on this CPU.

    Where the CPU has AVX512-BF16 but no AMX tiles, the kernel's bf16 pair products beat
    torch's flash attention; where it has AMX, torch multiplies on the tiles and wins, so
    chunks stay there (measured per kind of CPU: docs/kernels.md).
    """
    if dtype != torch.bfloat16 or quantized_kv:
        return False
    flags = build.cpu_flags()
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    pages: torch.Tensor,
    page_starts: torch.Tensor,
    q_starts: torch.Tensor,
    ctx_lens: torch.Tensor,
    page_size: int,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its paged context.

    q `[T, Hq, D]` (sequences' new tokens back to back, `q_starts` `[B+1]` their
    offsets); k/v `[slots, Hkv, D]` one layer's store with slot = page * page_size +
    offset (int8 with per-slot, per-head scales `[slots, Hkv]`); sequence b's pages
    are `pages[page_starts[b]:page_starts[b+1]]`, its context `ctx_lens[b]` tokens,
    the last of them its new tokens. q may be strided by token and head (a view of the
    fused qkv projection), as long as each head's D values are contiguous.

    `new_kv` (k_new, v_new, slots), for bf16/fp32 stores: the new tokens' K/V `[T, Hkv,
    D]` (each token's values contiguous), stored at `slots` before attending.

    `window`: a sliding-window layer's: a query at position p sees keys from
    p - window + 1 on.
    """
    k_new, v_new, slots = new_kv if new_kv is not None else (None, None, None)
    return torch.ops.kvchat.paged_attention(
        q,
        k,
        v,
        k_scale,
        v_scale,
        pages,
        page_starts,
        q_starts,
        ctx_lens,
        page_size,
        scale,
        k_new,
        v_new,
        slots,
        window or 0,
    )
