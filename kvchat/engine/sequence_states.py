"""Each live sequence's linear-attention state, for a hybrid model (Qwen3.5's Gated DeltaNet
layers), kept between the steps that compute it.

A linear layer carries a fixed-size state from one token to the next instead of reading
K/V pages (`model.gated_deltanet`). A sequence's kept state is the one after its last
computed token, so a step that continues the sequence starts from it. A step that starts
it anywhere else starts from zeros (its first token), or from the state the page table
kept where its cached prefix ends (`PageTable.resume_state`, `cache.state_snapshots`).
Every step also asks for the states where it ends a page of the cache, which the engine
hands to the table so later requests can resume there (`StepStates.kept`).

The engine's step thread alone reads and writes these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchat.model.gated_deltanet import DeltaNetState

States = list[DeltaNetState | None]  # one per linear layer (None: not run yet: zeros)


class SequenceStates:
    """seq id -> its linear layers' states, and the position they are after."""

    def __init__(self, linear_layers: int, page_size: int) -> None:
        self.linear_layers = linear_layers
        self.page_size = page_size
        self._states: dict[int, States] = {}
        self._after: dict[int, int] = {}  # seq id -> the tokens its states have seen

    def for_step(
        self,
        runs: Sequence[tuple[int, int, int]],
        resume: Callable[[int], Sequence[DeltaNetState] | None],
    ) -> StepStates:
        """The `RecurrentStates` of one forward whose runs are (seq id, first position,
        new tokens); `resume(seq_id)` is the state a sequence admitted at a cached prefix
        starts from."""
        lists, keep_at = [], []
        S = self.page_size
        for seq_id, start, n in runs:
            if self._after.get(seq_id) != start:
                if start == 0:
                    self._states[seq_id] = [None] * self.linear_layers
                else:
                    kept = resume(seq_id)
                    if kept is None:
                        raise RuntimeError(f"sequence {seq_id} resumes at {start} without a state")
                    self._states[seq_id] = list(kept)
            self._after[seq_id] = start + n
            lists.append(self._states[seq_id])
            keep_at.append(tuple(range(S - start % S, n + 1, S)))  # where its pages end
        return StepStates(lists, keep_at)

    def forget_ended(self, is_live: Callable[[int], bool]) -> None:
        """Forget the states of sequences that ended."""
        for seq_id in [s for s in self._states if not is_live(s)]:
            del self._states[seq_id]
            self._after.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._states)


class StepStates:
    """`model.batch.RecurrentStates` over the step's runs: reads and writes go to the
    sequences' kept lists, so the next step continues from them; the states at page ends
    are gathered in `kept`."""

    def __init__(self, runs: list[States], keep_at: list[tuple[int, ...]]) -> None:
        self._runs = runs
        self._keep_at = keep_at
        self.kept: dict[tuple[int, int], States] = {}  # (run, offset) -> every layer's

    def state(self, layer: int, run: int) -> DeltaNetState | None:
        return self._runs[run][layer]

    def update(self, layer: int, run: int, state: DeltaNetState) -> None:
        self._runs[run][layer] = state

    def keep_at(self, run: int) -> Sequence[int]:
        return self._keep_at[run]

    def keep(self, layer: int, run: int, offset: int, state: DeltaNetState) -> None:
        layers = self.kept.setdefault((run, offset), [None] * len(self._runs[run]))
        layers[layer] = state
