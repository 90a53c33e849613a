"""What the service knows of a session beyond its stored rows: its live turn.

`PendingTurn` is one turn a caller submitted (a say, an edit-and-resend, a regenerate) waiting
to be sized and started; `SessionRuntime` is the session's reply under way, the
turns queued behind it, its type-ahead and the flags a UI shows. Neither is persisted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvchat.chat.session import Message, TurnState, TurnStats
from kvchat.chat.type_ahead_prompt import SessionTypeAhead
from kvchat.engine.api import SamplingParams


@dataclass(frozen=True)
class PendingTurn:
    """A turn submitted and not started yet: sized by the planner, then started in order."""

    number: int  # the service's count of turns submitted: `SessionFailed.turn` names it
    text: str
    sampling: SamplingParams | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    title: str | None = None  # the session's title once the turn starts (a new chat's)
    cut_at: int | None = None  # edit-and-resend: history is cut at this message first
    regenerate: bool = False  # no new message: the last reply is replaced
    waited: bool = False  # submitted while the session was busy: it waited its turn


@dataclass
class SessionRuntime:
    """Per-session state that is not persisted: the live request and UI flags."""

    request_id: int | None = None
    state: TurnState = TurnState.IDLE
    message: Message | None = None  # the assistant message being written
    turn: int = 0
    generated: list[int] = field(default_factory=list)
    queue: deque[PendingTurn] = field(default_factory=deque)  # waiting, in submit order
    unread: bool = False
    notice: str | None = None
    last_stats: TurnStats | None = None
    unsaved_tokens: int = 0
    last_save: float = 0.0
    type_ahead: SessionTypeAhead = field(default_factory=SessionTypeAhead)
    planning: PendingTurn | None = None  # the turn being sized now, outside the lock
    stop_at_start: bool = False  # `stop` came while the turn was sized: cancel it as it starts

    @property
    def busy(self) -> bool:
        return self.state != TurnState.IDLE or bool(self.queue) or self.planning is not None

    @property
    def queued_turns(self) -> int:
        """Turns waiting for the reply before them (one being sized after it counts)."""
        waiting = self.planning is not None and self.planning.waited
        return len(self.queue) + waiting
