"""What one forward pass computes: a packed batch of token runs from several sequences.

The engine packs, per sequence, the tokens it wants computed this step (a prefill
chunk or one decode token) into one flat run; `positions` say where each token
sits in its own sequence. The attention implementation receives the same
description and decides where K/V live (paged in `engine/`, or nowhere in
`NoCacheAttention` for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, every sequence's new tokens, packed
    positions: torch.Tensor  # [T] int64, each token's position in its own sequence
    query_lens: tuple[int, ...]  # new tokens per sequence (sum == T)
    context_lens: tuple[int, ...]  # tokens each sequence attends to after this step
    logits_indices: torch.Tensor  # [N] flat indices whose logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    @classmethod
    def from_runs(
        cls,
        runs: list[list[int]],
        start_positions: list[int],
        device: torch.device | str = "cpu",
        all_logits: bool = False,
    ) -> ForwardBatch:
        """Build a batch from per-sequence token runs; logits of each run's last token."""
        ids: list[int] = []
        pos: list[int] = []
        logits: list[int] = []
        for run, start in zip(runs, start_positions, strict=True):
            if all_logits:
                logits.extend(range(len(ids), len(ids) + len(run)))
            ids.extend(run)
            pos.extend(range(start, start + len(run)))
            if not all_logits:
                logits.append(len(ids) - 1)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            query_lens=tuple(len(r) for r in runs),
            context_lens=tuple(s + len(r) for r, s in zip(runs, start_positions, strict=True)),
            logits_indices=torch.tensor(logits, dtype=torch.long, device=device),
        )


class Attention(Protocol):
    """Where K/V are stored and how queries read them; one call per layer per forward."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> attention output [T, Hq, D].

        `window`: each query sees only the last `window` positions up to its own (a
        sliding-window layer); None: all of them. Layers without a window leave it out."""
        ...


def window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """[n, L] True where a query at its position sees a key at its: causal and, with a
    window, no further back than `window - 1` positions (transformers' sliding window)."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen


class NoCacheAttention:
    """Causal attention within each run of the batch, every run starting at position 0.

    Stores nothing: the reference implementation the paged one is tested against, and
    the path for whole-sequence scoring (perplexity).
    """

    def __init__(self, batch: ForwardBatch):
        self.batch = batch

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
    ):
        out = torch.empty_like(q)
        start = 0
        for n in self.batch.query_lens:
            qs = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
            ks = k[start : start + n].transpose(0, 1)  # [Hkv, n, D]
            vs = v[start : start + n].transpose(0, 1)
            if window is None or n <= window:
                mask, causal = None, True
            else:
                positions = torch.arange(n, device=q.device)
                mask, causal = window_mask(positions, positions, window), False
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return out
