"""Which device store holds each layer's K/V: the full-attention layers' or the windowed ones'.

A layer that attends within a window (Gemma 3's five layers of six, gpt-oss's every
other layer) never reads a position more than `window - 1` before its query, so once a
sequence has moved past a page, that layer's part of the page is dead weight. Such
models keep their windowed layers' K/V in a store of its own, with a slot for each page
whose window part is still kept (`cache.window_slots`), while the full-attention layers
keep every page. A model with no windowed layers, or with only windowed ones, keeps
every layer in the one store, as before.

The host and disk tiers keep a page's layers in the model's order, all of them, so their
formats do not depend on the split (`tiers.kv_store.KVPageMover`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    """The model's layers split by store; `window` is what the windowed layers attend within."""

    num_layers: int
    full: tuple[int, ...]  # model layer indices, in order
    windowed: tuple[int, ...] = ()
    window: int | None = None

    @classmethod
    def of(cls, layer_windows: Sequence[int | None] | None, num_layers: int) -> LayerGroups:
        """The split for a model whose layer `i` attends within `layer_windows[i]` tokens
        (None: the whole context). One group unless both kinds of layer are present."""
        windows = list(layer_windows or [None] * num_layers)
        windowed = tuple(i for i, w in enumerate(windows) if w is not None)
        full = tuple(i for i, w in enumerate(windows) if w is None)
        if not windowed or not full:
            return cls(num_layers, tuple(range(num_layers)))
        return cls(num_layers, full, windowed, max(w for w in windows if w is not None))

    @property
    def split(self) -> bool:
        """Whether the windowed layers have a store of their own."""
        return bool(self.windowed)

    def locations(self) -> tuple[tuple[bool, int], ...]:
        """For each model layer: (in the windowed store, its index in its store)."""
        where = {layer: (False, i) for i, layer in enumerate(self.full)}
        where.update({layer: (True, i) for i, layer in enumerate(self.windowed)})
        return tuple(where[layer] for layer in range(self.num_layers))
