"""torch's CPU attention sees shapes from a small set, and the rounding changes no result.

torch's bf16 flash attention keeps a kernel for every block shape it meets (a long-running
process grew without end: docs/reliability.md). The first test records every call the
paged attention makes into torch while chunks of many lengths follow prefixes of many
lengths, and fails if calls with many query rows come in unrounded shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.engine.attention import flash_shapes
from kvchat.engine.attention.flash_shapes import KEY_GRANULE, ROW_GRANULE
from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.model.batch import ForwardBatch

HKV, GROUP, D = 3, 3, 16


def _record_torch_calls(monkeypatch) -> list[tuple[int, int]]:
    """(query rows, keys) of every call into torch's attention from here on."""
    seen: list[tuple[int, int]] = []
    sdpa, flash = (
        F.scaled_dot_product_attention,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
    )

    def record_sdpa(q, k, v, *args, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, v, *args, **kwargs)

    def record_flash(q, k, v, *args, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return flash(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record_sdpa)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", record_flash)
    return seen


@pytest.mark.parametrize("page_size", [16, 64])
def test_chunks_of_any_length_reach_torch_in_rounded_shapes(monkeypatch, page_size) -> None:
    """Chunks of 1..80 tokens after prefixes of 0..400 tokens, contiguous and scattered,
    by runs and by one masked call: every call with `ROW_GRANULE` rows or more has its
    rows a multiple of it and its keys a multiple of the page size or `KEY_GRANULE`."""
    g = torch.Generator().manual_seed(page_size)
    pages = 600 // page_size + 2
    k_all = torch.randn(1, pages, page_size, HKV, D, generator=g).to(torch.bfloat16)
    v_all = torch.randn(1, pages, page_size, HKV, D, generator=g).to(torch.bfloat16)
    attention = PagedAttention(k_all, v_all)
    attention.native_enabled = False
    seen = _record_torch_calls(monkeypatch)
    scattered = list(range(pages))[::2] + list(range(pages))[1::2]
    for n in (1, 5, 11, 12, 23, 37, 50, 64, 80):
        for start in (0, 3, 17, 100, 131, 257, 400):
            for page_list in (list(range(pages)), scattered):
                q = torch.randn(n, HKV * GROUP, D, generator=g).to(torch.bfloat16)
                kv = torch.randn(2, n, HKV, D, generator=g).to(torch.bfloat16)
                attention.prepare(ForwardBatch.from_runs([list(range(n))], [start]), [page_list])
                attention(0, q, kv[0], kv[1])
    many_rows = [(rows, keys) for rows, keys in seen if rows >= ROW_GRANULE]
    assert many_rows, "no call had many rows: the test tested nothing"
    granule = min(page_size, KEY_GRANULE)
    odd = sorted({(r, k) for r, k in many_rows if r % ROW_GRANULE or k % granule})
    assert not odd, f"shapes torch would build new kernels for: {odd[:10]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "length"), [(5, 7), (31, 40), (32, 64), (33, 70), (100, 129)])
def test_rounded_calls_equal_the_plain_ones(dtype, m, length) -> None:
    """Each entry point gives what torch gives for the unrounded shapes."""
    g = torch.Generator().manual_seed(m * length)
    q = torch.randn(1, HKV, m, D, generator=g).to(dtype)
    k = torch.randn(1, HKV, length, D, generator=g).to(dtype)
    v = torch.randn(1, HKV, length, D, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)

    plain = F.scaled_dot_product_attention(q, k, v)
    assert close(flash_shapes.attend(q, k, v), plain)
    out, lse = flash_shapes.over_keys_with_lse(q, k, v)
    plain_out, plain_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    assert close(out, plain_out) and close(lse, plain_lse)

    # a mask that blocks a different part of each row, at its size and grown beforehand
    blocked = torch.rand(m, length, generator=g) < 0.3
    blocked[:, 0] = False
    mask = torch.zeros(m, length, dtype=dtype).masked_fill_(blocked, float("-inf"))
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grown = flash_shapes.pad_mask(mask, *flash_shapes.padded_shape(m, length, q.device))
    assert close(flash_shapes.attend(q, k, v, mask), plain)
    assert close(flash_shapes.attend(q, k, v, grown), plain)

    # causal: the same tokens as queries and keys
    kc, vc = k[:, :, :m], v[:, :, :m]
    plain = F.scaled_dot_product_attention(q, kc, vc, is_causal=True)
    assert close(flash_shapes.causal(q, kc, vc), plain)
    out, lse = flash_shapes.causal_with_lse(q, kc, vc)
    plain_out, plain_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, kc, vc, is_causal=True
    )
    assert close(out, plain_out) and close(lse, plain_lse)


def test_shapes_are_left_alone_off_the_cpu_and_for_few_rows() -> None:
    """Rounding is only for torch's CPU kernels, and only where they would build one."""
    assert flash_shapes.padded_shape(ROW_GRANULE - 1, 77, torch.device("cpu")) == (31, 77)
    assert flash_shapes.padded_shape(40, 77, torch.device("cpu")) == (64, 2 * KEY_GRANULE)
    assert flash_shapes.padded_shape(40, 77, torch.device("cuda")) == (40, 77)
