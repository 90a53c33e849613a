"""A long decode's attention, sliced and merged by log-sum-exp, equals the one-call result."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.attention import paged_attention
from kvchat.engine.attention.paged_attention import PagedAttention
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


@pytest.mark.parametrize("kv", ["native", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("pages", "start", "n"),
    [
        ([4, 5, 0, 1, 2, 9, 7], 70, 30),  # three runs of prefix, the chunk over two pages
        ([8, 2, 3, 6], 33, 5),  # the chunk inside one page after a partial run
        ([1, 0], 16, 16),  # a prefix of exactly one page, the chunk filling the next
        ([3, 4, 5, 6, 7], 40, 30),  # one run of pages: the prefix read as one slice
        ([2, 3], 1, 20),  # a prefix of one token
        ([4, 5, 0, 1, 8], 10, 50),  # a short prefix in two runs before a long chunk
    ],
)
# 10**9: always part by part; 0: always one causal call over the whole context (the path
# a chunk SHORT_PREFIX_RATIO times longer than its prefix takes)
@pytest.mark.parametrize("short_prefix_ratio", [10**9, 0])
def test_a_chunk_read_by_runs_of_pages_equals_one_masked_call(
    monkeypatch, pages, start, n, dtype, kv, short_prefix_ratio
) -> None:
    """Runs of pages attended in place, the new tokens causal among themselves, merged by
    log-sum-exp (or, after a short prefix, one causal call over the whole context with the
    chunk's queries padded to their positions), equal one masked call over the (gathered)
    context, and both equal attention written out directly."""
    monkeypatch.setattr(paged_attention, "SHORT_PREFIX_RATIO", short_prefix_ratio)
    g = torch.Generator().manual_seed(start + n)
    store_pages = max(pages) + 1
    k_all = torch.randn(1, store_pages, PAGE, HKV, D, generator=g).to(dtype)
    v_all = torch.randn(1, store_pages, PAGE, HKV, D, generator=g).to(dtype)
    scales = None
    if kv == "int8":  # codes and per-token scales, as the int8 store keeps them
        scales = [(torch.rand(1, store_pages, PAGE, HKV, generator=g) / 20).to(dtype)
                  for _ in range(2)]  # fmt: skip
        k_all = torch.randint(-127, 128, k_all.shape, generator=g, dtype=torch.int8)
        v_all = torch.randint(-127, 128, v_all.shape, generator=g, dtype=torch.int8)
    q = torch.randn(n, HKV * GROUP, D, generator=g).to(dtype)
    k_new = torch.randn(n, HKV, D, generator=g).to(dtype)
    v_new = torch.randn(n, HKV, D, generator=g).to(dtype)

    def chunk(max_runs: int) -> tuple[torch.Tensor, PagedAttention]:
        monkeypatch.setattr(paged_attention, "MAX_PREFIX_RUNS", max_runs)
        extra = (None, None) if scales is None else (scales[0].clone(), scales[1].clone())
        attention = PagedAttention(k_all.clone(), v_all.clone(), *extra)
        attention.native_enabled = False
        attention.prepare(ForwardBatch.from_runs([list(range(n))], [start]), [pages])
        assert (attention._views[0].prefix_runs is not None) == (max_runs > 0)
        return attention(0, q, k_new, v_new), attention

    by_runs, attention = chunk(8)
    gathered, _ = chunk(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(by_runs.float(), gathered.float(), atol=tol, rtol=tol)
    # directly: the stored context (dequantized for int8), causal over the new tokens
    total = start + n
    slots = [pages[p // PAGE] * PAGE + p % PAGE for p in range(total)]
    keys = attention._gather(attention._layers[0][0], torch.tensor(slots)).float()
    values = attention._gather(attention._layers[0][1], torch.tensor(slots)).float()
    keys, values = keys.repeat_interleave(GROUP, dim=1), values.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("thd,lhd->htl", q.float(), keys) / D**0.5
    visible = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]  # [n, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
    assert torch.allclose(by_runs.float(), expected, atol=tol * 2, rtol=tol * 2)
