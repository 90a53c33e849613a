"""Pick the next token from logits: greedy, or temperature with top-k / top-p / min-p.

Each request samples with its own `torch.Generator`, seeded from its seed, so the
same seed gives the same output whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.engine import sequence
from kvchat.engine.request import SamplingParams

NON_FINITE_LOGITS = (
    "The model produced NaN or infinite logits, so no token can be chosen. The model file "
    "may be corrupt, or its weights overflow this dtype: try --dtype float32, or re-download "
    "the model."
)


def sample_step(
    logits: torch.Tensor,  # [rows, vocab]: one row per run that ends in a token to sample
    runs: Sequence[tuple[sequence.Sequence, int]],
) -> list[int | None]:
    """A step's sampled tokens, one per logits row in the runs' order; None where the row
    is not finite (that request fails, `NON_FINITE_LOGITS`, the others go on)."""
    logits = logits.cpu()
    all_finite = bool(torch.isfinite(logits).all())  # one check a step; per row only if not
    sampled: list[int | None] = []
    for seq, n in runs:
        if not seq.samples_after(n):
            continue
        row = logits[len(sampled)]
        if not all_finite and not bool(torch.isfinite(row).all()):
            sampled.append(None)
            continue
        sampled.append(sample_next(row, seq.request.sampling, seq.generator, seq.tokens))
    return sampled


def apply_repetition_penalty(
    logits: torch.Tensor, seen: Sequence[int], penalty: float
) -> torch.Tensor:
    """transformers' rule: positive logits of seen tokens are divided by the penalty,
    negative ones multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
    picked = logits[idx]
    logits = logits.clone()
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample_next(
    logits: torch.Tensor,  # [vocab] float32
    params: SamplingParams,
    generator: torch.Generator | None,
    seen: Sequence[int] = (),
) -> int:
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        kept, ids = nucleus(probs, params.top_p)
        return int(ids[draw(kept, generator)])
    return draw(probs, generator)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` (>= 0, not all 0), by
    inverting their cumulative sum at one uniform number: `torch.multinomial` took ~1 ms
    over a 49k vocabulary, this ~0.05 ms. A zero weight is never drawn."""
    cumulative = torch.cumsum(weights, dim=-1)
    u = torch.rand(1, generator=generator, dtype=cumulative.dtype) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, u, right=True))
    if index < weights.shape[-1]:
        return index
    return int(weights.nonzero()[-1])  # u rounded up onto the total: the last nonzero weight


NUCLEUS_FIRST_GUESS = 64  # tokens: a chat model's nucleus at top-p 0.9 is usually smaller


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, token ids) of the smallest set of most likely tokens whose mass
    reaches `top_p` (the most likely token always stays), most likely first.

    Why not sort the vocabulary: a full sort of 49k probabilities took ~5 ms a token on
    the target CPU, a third of a decode step. The nucleus is found among the top 64
    (`topk`, ~0.1 ms), widened 8x at a time only when their mass falls short; the set
    is the one the full sort gives.
    """
    n = probs.shape[-1]
    k = NUCLEUS_FIRST_GUESS
    while True:
        k = min(k, n)
        top, ids = torch.topk(probs, k)  # descending
        cumulative = torch.cumsum(top, dim=-1)
        # complete when the mass before every token left out already exceeds top_p
        if k == n or float(cumulative[-1]) > top_p:
            return top.masked_fill(cumulative - top > top_p, 0.0), ids
        k *= 8
