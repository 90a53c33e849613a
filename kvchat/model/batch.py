"""What one forward pass computes: a packed batch of token runs from several sequences.

The engine packs, per sequence, the tokens it wants computed this step (a prefill
chunk or one decode token) into one flat run; `positions` say where each token
sits in its own sequence. The attention implementation receives the same
description and decides where K/V live (paged in `engine/`, or nowhere in
`NoCacheAttention` for tests). A hybrid model's linear-attention layers (Qwen3.5) keep
no K/V: they read and write one fixed-size state per sequence and layer through
`RecurrentStates` (kept by the engine, or by `FreshStates` for a whole prompt and tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvchat.model.gated_deltanet import DeltaNetState


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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> attention output [T, Hq, D].

        `window`: each query sees only the last `window` positions up to its own (a
        sliding-window layer); None: all of them. `sinks` [Hq]: a logit per query head
        that joins its softmax with no value (gpt-oss). Layers without them leave them out."""
        ...


class RecurrentStates(Protocol):
    """Where a hybrid model's linear-attention layers keep each sequence's state between
    forwards; every such layer reads and then writes it once per run per forward.

    `layer`: the layer's place among the model's linear-attention layers
    (`ModelConfig.linear_layers`), 0 to n_linear - 1, not its index among all layers.
    `run`: the sequence's place in `batch.query_lens`. The state a forward is given must be
    the one left after the tokens before this run's first (its positions start there)."""

    def state(self, layer: int, run: int) -> DeltaNetState | None:
        """The state before this run's new tokens; None: the sequence starts here, from
        zeros."""
        ...

    def update(self, layer: int, run: int, state: DeltaNetState) -> None:
        """The state after this run's new tokens (new tensors: the given ones are not
        written in place)."""
        ...

    def keep_at(self, run: int) -> Sequence[int]:
        """Where within this run's new tokens (ascending counts, 1 to its length) the
        caller wants the state as well: where a page of the cache ends."""
        ...

    def keep(self, layer: int, run: int, offset: int, state: DeltaNetState) -> None:
        """The state after the run's first `offset` new tokens, for an offset `keep_at` named."""
        ...


class FreshStates:
    """Every run starts from zeros; each update is kept and handed back by `state`, so the
    same object passed to the next forward carries its runs on (the same runs in the same
    order: runs are told apart by index only). For a whole prompt and for tests."""

    def __init__(self) -> None:
        self.saved: dict[tuple[int, int], DeltaNetState] = {}  # (layer, run) -> the latest

    def state(self, layer: int, run: int) -> DeltaNetState | None:
        return self.saved.get((layer, run))

    def update(self, layer: int, run: int, state: DeltaNetState) -> None:
        self.saved[(layer, run)] = state

    def keep_at(self, run: int) -> Sequence[int]:
        return ()

    def keep(self, layer: int, run: int, offset: int, state: DeltaNetState) -> None:
        raise AssertionError("no state was asked to be kept")


def window_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """[n, L] True where a query at its position sees a key at its: causal and, with a
    window, no further back than `window - 1` positions (transformers' sliding window)."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] over k/v [L, Hkv, D] -> [n, Hq, D], where `allowed` [n, L] (None:
    every key for every query) and with each head's sink logit in its softmax.

    Without sinks this is SDPA. With them, the scores, the sink column and the softmax
    are computed in float32 (transformers' eager attention for gpt-oss, in the model's
    dtype there) and the sink's share of each row is dropped before the values."""
    if sinks is None:
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=allowed,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    values = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * dim**-0.5  # [Hq, n, L]
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    sink = sinks.float()[:, None, None].expand(heads, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, values).to(q.dtype)


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
        sinks: torch.Tensor | None = None,
    ):
        out = torch.empty_like(q)
        start = 0
        for n in self.batch.query_lens:
            rows = slice(start, start + n)
            start += n
            if sinks is None and (window is None or n <= window):
                o = torch.nn.functional.scaled_dot_product_attention(
                    q[rows].transpose(0, 1),  # [Hq, n, D]
                    k[rows].transpose(0, 1),  # [Hkv, n, D]
                    v[rows].transpose(0, 1),
                    is_causal=True,
                    enable_gqa=True,
                )
                out[rows] = o.transpose(0, 1)
                continue
            positions = torch.arange(n, device=q.device)
            allowed = window_mask(positions, positions, window)
            out[rows] = reference_attention(q[rows], k[rows], v[rows], allowed, sinks)
        return out
