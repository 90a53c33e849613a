"""Each live sequence's linear-attention state, for a hybrid model (Qwen3.5's Gated DeltaNet
layers), kept between the steps that compute it.

A linear layer carries a fixed-size state from one token to the next instead of reading
K/V pages (`model.gated_deltanet`). A sequence's state is the state after its last
computed token, so a step that continues a sequence starts from it, and a step that
computes a sequence from its first token starts from zeros: that is how a sequence that
was admitted again (preempted, or a new turn) starts afresh. The page table never hands
such a model a cached prefix yet (a state at the prefix's end would have to be kept:
`PageTable(prefix_reuse=False)`), so every admission computes from the first token.

The engine's step thread alone reads and writes these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchat.model.gated_deltanet import DeltaNetState


class SequenceStates:
    """seq id -> its linear layers' states (None: a layer not run yet: zeros)."""

    def __init__(self, linear_layers: int) -> None:
        self.linear_layers = linear_layers
        self._states: dict[int, list[DeltaNetState | None]] = {}

    def for_step(self, seq_ids: Sequence[int], starts: Sequence[int]) -> StepStates:
        """The `RecurrentStates` of one forward whose runs are these sequences, each
        computed from position `starts[i]` (0: from zeros, whatever was kept before)."""
        for seq_id, start in zip(seq_ids, starts, strict=True):
            if start == 0 or seq_id not in self._states:
                self._states[seq_id] = [None] * self.linear_layers
        return StepStates([self._states[s] for s in seq_ids])

    def forget_ended(self, is_live: Callable[[int], bool]) -> None:
        """Forget the states of sequences that ended."""
        for seq_id in [s for s in self._states if not is_live(s)]:
            del self._states[seq_id]

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> int:
        """Bytes the kept states take (the meters' figure for a hybrid model)."""
        return sum(
            s.conv.nbytes + s.recurrent.nbytes
            for states in self._states.values()
            for s in states
            if s is not None
        )


class StepStates:
    """`model.batch.RecurrentStates` over the step's runs: reads and writes go to the
    sequences' kept lists, so the next step continues from them."""

    def __init__(self, runs: list[list[DeltaNetState | None]]) -> None:
        self._runs = runs

    def state(self, layer: int, run: int) -> DeltaNetState | None:
        return self._runs[run][layer]

    def update(self, layer: int, run: int, state: DeltaNetState) -> None:
        self._runs[run][layer] = state
