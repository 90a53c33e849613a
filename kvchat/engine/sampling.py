"""Pick the next token from logits: greedy, or temperature with top-k / top-p / min-p.

Each request samples with its own `torch.Generator`, seeded from its seed, so the
same seed gives the same output whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.engine.request import SamplingParams


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
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs > params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
