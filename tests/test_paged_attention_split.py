"""A long decode's attention, sliced and merged by log-sum-exp, equals the one-call result."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine import paged_attention
from kvchat.engine.paged_attention import PagedAttention
from kvchat.model.batch import ForwardBatch

PAGE, HKV, GROUP, D = 16, 3, 3, 8


@pytest.mark.parametrize("context", [64, 67, 150])  # divisible by the splits, and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_decode_attention_equals_the_single_call(monkeypatch, context, dtype) -> None:
    g = torch.Generator().manual_seed(context)
    pages = (context + PAGE - 1) // PAGE + 1
    k_all = torch.randn(1, pages, PAGE, HKV, D, generator=g).to(dtype)
    v_all = torch.randn(1, pages, PAGE, HKV, D, generator=g).to(dtype)
    q = torch.randn(1, HKV * GROUP, D, generator=g).to(dtype)
    k_new = torch.randn(1, HKV, D, generator=g).to(dtype)
    v_new = torch.randn(1, HKV, D, generator=g).to(dtype)

    def decode(split_from: int) -> torch.Tensor:
        monkeypatch.setattr(paged_attention, "SPLIT_DECODE_FROM", split_from)
        attention = PagedAttention(k_all.clone(), v_all.clone())
        batch = ForwardBatch.from_runs([[7]], [context - 1])
        attention.prepare(batch, [list(range(pages))])
        return attention(0, q, k_new, v_new)

    sliced, whole = decode(1), decode(1 << 30)
    assert sliced.shape == whole.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(sliced.float(), whole.float(), atol=tol, rtol=tol)
    # and both equal attention computed directly over the context
    keys = torch.cat([k_all[0].reshape(-1, HKV, D)[: context - 1], k_new]).float()
    values = torch.cat([v_all[0].reshape(-1, HKV, D)[: context - 1], v_new]).float()
    keys, values = keys.repeat_interleave(GROUP, dim=1), values.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,lhd->hl", q[0].float(), keys) / D**0.5
    expected = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    assert torch.allclose(sliced[0].float(), expected, atol=tol * 2, rtol=tol * 2)
