"""kvchat's logits for the parity tests: the relative error, and a forward paged or not."""

from __future__ import annotations

import torch

from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.model.batch import ForwardBatch, NoCacheAttention


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def kvchat_logits(model, ids: list[int], *, paged: bool, page_size: int = 16) -> torch.Tensor:
    """All positions' logits; `paged` runs a prefill chunk then one decode step per token."""
    t = model.transformer
    if not paged:
        batch = ForwardBatch.from_runs([ids], [0], all_logits=True)
        return t.forward(batch, NoCacheAttention(batch))
    c = model.config
    pages = (len(ids) + page_size) // page_size + 1
    k_all = torch.zeros(c.num_layers, pages, page_size, c.num_kv_heads, c.head_dim, dtype=t.dtype)
    attention = PagedAttention(k_all, torch.zeros_like(k_all))
    page_list = list(range(pages))[::-1]  # deliberately not contiguous
    split = len(ids) * 2 // 3
    batch = ForwardBatch.from_runs([ids[:split]], [0], all_logits=True)
    attention.prepare(batch, [page_list])
    out = [t.forward(batch, attention)]
    for pos in range(split, len(ids)):
        batch = ForwardBatch.from_runs([[ids[pos]]], [pos])
        attention.prepare(batch, [page_list])
        out.append(t.forward(batch, attention))
    return torch.cat(out)
