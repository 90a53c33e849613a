"""The parity tests' tools: kvchat's logits (a forward paged or not), transformers' (the
oracle), the relative error between them, and seeded token ids."""

from __future__ import annotations

import torch

from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.model.batch import ForwardBatch, FreshStates, NoCacheAttention


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def kvchat_logits(model, ids: list[int], *, paged: bool, page_size: int = 16) -> torch.Tensor:
    """All positions' logits; `paged` runs a prefill chunk then one decode step per token
    (a hybrid model's linear layers carrying their state from each forward to the next)."""
    t = model.transformer
    if not paged:
        batch = ForwardBatch.from_runs([ids], [0], all_logits=True)
        return t.forward(batch, NoCacheAttention(batch))
    c = model.config
    pages = (len(ids) + page_size) // page_size + 1
    k_all = torch.zeros(c.kv_layers, pages, page_size, c.num_kv_heads, c.head_dim, dtype=t.dtype)
    attention = PagedAttention(k_all, torch.zeros_like(k_all))
    page_list = list(range(pages))[::-1]  # deliberately not contiguous
    split = len(ids) * 2 // 3
    batch = ForwardBatch.from_runs([ids[:split]], [0], all_logits=True)
    attention.prepare(batch, [page_list])
    states = FreshStates()
    out = [t.forward(batch, attention, states)]
    for pos in range(split, len(ids)):
        batch = ForwardBatch.from_runs([[ids[pos]]], [pos])
        attention.prepare(batch, [page_list])
        out.append(t.forward(batch, attention, states))
    return torch.cat(out)


def hf_model(folder, dtype=torch.float32):
    """transformers' model of a folder: the oracle of the family tests."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_logits(folder, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """transformers' logits [n, vocab] at every position of `ids`, in float32."""
    with torch.no_grad():
        return hf_model(folder, dtype)(ids[None]).logits[0].float()


def random_ids(n: int, seed: int, low: int = 0) -> torch.Tensor:
    """`n` seeded token ids below 512 (the tiny models' vocabulary), from `low`."""
    return torch.randint(low, 512, (n,), generator=torch.Generator().manual_seed(seed))


def native_error(native, dense, n: int = 48, seed: int = 4) -> float:
    """The relative error of a model with its file's quantized layers against the same
    file dequantized, over `n` seeded ids, a prefill then decode steps (`kvchat_logits`)."""
    ids = torch.randint(
        0, native.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    return rel_err(kvchat_logits(native, ids, paged=True), kvchat_logits(dense, ids, paged=True))
