"""The forward batch of one step: each scheduled run's tokens, positions and pages.

Runs are laid end to end in one flat batch; logits are kept only where a run
reaches the end of its sequence's tokens (the next token is sampled there), so a
prefill chunk in the middle of a prompt costs no logits, and a type-ahead's chunk
(last in the step) none at all.
"""

from __future__ import annotations

import torch

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.scheduler import StepPlan
from kvchat.model.batch import ForwardBatch


def build_batch(
    plan: StepPlan, table: PageTable, device: torch.device
) -> tuple[ForwardBatch, list[tuple[int, ...]], list[tuple[int, ...]] | None]:
    """The batch for `plan`'s runs, each run's page list, and where the model keeps its
    windowed layers apart, each run's window slots (given here to the pages it writes)."""
    starts = [seq.num_computed for seq, _ in plan.runs]
    query_lens = [n for _, n in plan.runs]
    page_lists = [table.pages(seq.id) for seq, _ in plan.runs]
    window_lists = None
    if table.window is not None:
        window_lists = [table.window_pages(seq.id, seq.num_computed + n) for seq, n in plan.runs]
    ids: list[int] = []
    positions: list[int] = []
    logits_at: list[int] = []
    for (seq, n), start in zip(plan.runs, starts, strict=True):
        ids.extend(seq.tokens[start : start + n])
        positions.extend(range(start, start + n))
        if seq.samples_after(n):  # the chunk reaches the end: sample after it
            logits_at.append(len(ids) - 1)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        query_lens=tuple(query_lens),
        context_lens=tuple(s + n for s, n in zip(starts, query_lens, strict=True)),
        logits_indices=torch.tensor(logits_at, dtype=torch.long, device=device),
    )
    return batch, page_lists, window_lists
