"""One layer's attention: kvchat's kernel against torch's SDPA, on the default model's heads.

    python benchmarks/attention_layer.py

For contexts of 1k, 3k and 6k tokens and 1, 8 or 20 new tokens (a decode, a small
prefill chunk, a follow-up turn): the median time of one layer's attention, bf16, 9
query heads over 3 kv heads of 64, K/V in 256-token pages. SDPA gets the context as one
strided tensor (the contiguous case, its best; one call, without the engine's 4-way
slicing of decodes from 4k tokens); the kernel reads it through the page list. Hot
caches: this is the kernels' own speed, not a decode step's (see `experiments/attention_ab.py`).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from kvchat.engine.attention import native_attention
from kvchat.native import build

HQ, HKV, D, PAGE = 9, 3, 64, 256
GROUP = HQ // HKV


def median_us(fn, runs: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask) -> torch.Tensor:
    """kvchat's SDPA path: query heads folded into their kv head's rows."""
    n = q.shape[0]
    rows = q.view(n, HKV, GROUP, D).permute(1, 0, 2, 3).reshape(1, HKV, n * GROUP, D)
    return F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask)


def main() -> None:
    build.request(wait=True)
    print(f"attention: {build.status().detail}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for context in (1024, 3072, 6144):
            pages = context // PAGE
            k = torch.randn(pages * PAGE, HKV, D, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            for n in (1, 8, 20):
                q = torch.randn(n, HQ, D, dtype=torch.bfloat16)
                positions = torch.arange(context - n, context)[:, None]
                blocked = (torch.arange(context)[None, :] > positions).repeat_interleave(GROUP, 0)
                mask = None
                if n > 1:
                    mask = torch.zeros(blocked.shape, dtype=torch.bfloat16)
                    mask.masked_fill_(blocked, float("-inf"))
                tables = (
                    torch.arange(pages),
                    torch.tensor([0, pages]),
                    torch.tensor([0, n]),
                    torch.tensor([context]),
                )
                kernel = median_us(
                    partial(
                        native_attention.paged_attention,
                        q, k, v, None, None, *tables, PAGE, D**-0.5,
                    )
                )  # fmt: skip
                torch_sdpa = median_us(partial(sdpa, q, keys, values, mask))
                print(
                    f"context {context:>5}, {n:>2} new: kernel {kernel:6.0f} us, "
                    f"SDPA {torch_sdpa:6.0f} us ({torch_sdpa / kernel:.2f}x)"
                )


if __name__ == "__main__":
    main()
