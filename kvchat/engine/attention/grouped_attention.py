"""Attention over a cache whose windowed layers keep their K/V in a store of their own.

Each store has its attention (`PagedAttention` or `FlexPagedAttention`), prepared once per
forward with its own page lists: the full-attention layers' are the table's pages, the
windowed layers' each page's window slot (`cache.window_slots`). A layer's call goes to
the attention of its store with its index there (`layer_groups.LayerGroups`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.engine.layer_groups import LayerGroups
from kvchat.model.batch import ForwardBatch


class GroupedAttention:
    """The `Attention` of a forward pass over a full and a windowed store."""

    def __init__(self, full, windowed, groups: LayerGroups) -> None:
        self.full = full
        self.windowed = windowed
        self._where = groups.locations()

    def uses_native(self) -> bool:
        return self.full.uses_native()

    @property
    def native_enabled(self) -> bool:
        return self.full.native_enabled

    @native_enabled.setter
    def native_enabled(self, on: bool) -> None:
        self.full.native_enabled = self.windowed.native_enabled = on

    @property
    def native_chunks(self) -> bool:
        return self.full.native_chunks

    @native_chunks.setter
    def native_chunks(self, on: bool) -> None:
        self.full.native_chunks = self.windowed.native_chunks = on

    def prepare(
        self,
        batch: ForwardBatch,
        page_lists: Sequence[Sequence[int]],
        window_page_lists: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """`window_page_lists`: each sequence's window slot for each of its pages (slot 0
        where the part was let go: the windowed layers never read there), from
        `PageTable.window_pages`, which also gives slots to the pages a step writes."""
        if window_page_lists is None:
            raise ValueError("a windowed store is read through the table's window slots")
        self.full.prepare(batch, page_lists)
        self.windowed.prepare(batch, window_page_lists)

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
        windowed, index = self._where[layer]
        attention = self.windowed if windowed else self.full
        return attention(index, q, k, v, window=window, sinks=sinks)
