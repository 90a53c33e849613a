"""One figure per cache tier: device, host and disk, always in that order.

Why one type: pages, cached tokens and residency are all "so much on each tier", and
they used to travel as three named fields in one place, a dict keyed by tier name in
another and positional fields in a third, so a consumer had to know which spelling it
was reading. `PerTier[T]` carries any such figure; subclasses add what only their
figure means (a total, a default).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

TIERS = ("device", "host", "disk")  # fastest first: the order every display uses


@dataclass(frozen=True)
class PerTier(Generic[T]):
    """A value of `T` for each tier of the KV cache."""

    device: T
    host: T
    disk: T

    def items(self) -> Iterator[tuple[str, T]]:
        """(tier name, value) pairs, fastest tier first."""
        yield "device", self.device
        yield "host", self.host
        yield "disk", self.disk
