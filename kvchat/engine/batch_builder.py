"""The forward batch of one step: each scheduled run's tokens, positions and pages.

Runs are laid end to end in one flat batch; logits are kept only where a run
reaches the end of its sequence's tokens (the next token is sampled there), so a
prefill chunk in the middle of a prompt costs no logits. A draft's chunk goes
last and asks for no logits at all.
"""

from __future__ import annotations

import torch

from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.drafts import DraftRun
from kvchat.engine.scheduler import StepPlan
from kvchat.model.batch import ForwardBatch


def build_batch(
    plan: StepPlan, draft: DraftRun | None, table: PageTable, device: torch.device
) -> tuple[ForwardBatch, list[tuple[int, ...]]]:
    """The batch for `plan`'s runs (and `draft`'s chunk), and each run's page list."""
    runs = [seq.tokens[seq.num_computed : seq.num_computed + n] for seq, n in plan.runs]
    starts = [seq.num_computed for seq, _ in plan.runs]
    query_lens = [n for _, n in plan.runs]
    page_lists = [table.pages(seq.id) for seq, _ in plan.runs]
    ids: list[int] = []
    positions: list[int] = []
    logits_at: list[int] = []
    for (seq, n), run, start in zip(plan.runs, runs, starts, strict=True):
        ids.extend(run)
        positions.extend(range(start, start + n))
        if start + n == len(seq.tokens):  # the chunk reaches the end: sample after it
            logits_at.append(len(ids) - 1)
    if draft is not None:
        ids.extend(draft.draft.tokens[draft.start : draft.start + draft.n])
        positions.extend(range(draft.start, draft.start + draft.n))
        starts.append(draft.start)
        query_lens.append(draft.n)
        page_lists.append(table.pages(draft.draft.id))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        query_lens=tuple(query_lens),
        context_lens=tuple(s + n for s, n in zip(starts, query_lens, strict=True)),
        logits_indices=torch.tensor(logits_at, dtype=torch.long, device=device),
    )
    return batch, page_lists
