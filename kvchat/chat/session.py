"""A conversation and the exact token ids of its rendered history.

The ids are the point: the next prompt is the stored ids plus what the new turn
adds, so the prefix the KV cache matched last turn matches again. Each message
remembers where its rendering starts in those ids (`offset`), so an edit cuts
the ids there and everything before the edit stays cached. `Session` and
`Message` are mutable and private to `SessionService`; what crosses threads and
layers are the frozen `SessionView`, `MessageView`, `SessionSnapshot` and `TurnStats`.
"""

from __future__ import annotations

import json
import time
import uuid
from array import array
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from kvchat.engine.api import (
    CachedTokens,
    FinishReason,
    RequestFinished,
    SamplingParams,
    hit_rate,
)


class TurnState(StrEnum):
    """Where a session's turn is: idle, or the state word of its request (the same words
    as the engine's `RequestState`)."""

    IDLE = "idle"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"


class MessageState(StrEnum):
    COMPLETE = "complete"
    STREAMING = "streaming"
    # cut before its end: the process writing it died (crash, kill), or a server's
    # stream broke after text arrived; the partial text is kept
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class TurnStats:
    """One reply's counters (docs/kv-cache.md): prompt = cached + prefilled."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: CachedTokens
    prefilled_tokens: int | None  # None: a server that does not report cached tokens
    recomputed_tokens: int | None  # None: a remote server (it does not report recompute)
    generated_tokens: int
    ttft_s: float | None
    decode_tok_s: float | None
    error: str | None = None
    # prompt tokens served from pages its type-aheads computed (in cached); the name is the
    # key stored with each message and printed by headless
    draft_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        """None when the backend did not report what was cached (never a made-up 0)."""
        if not self.cached_tokens.reported:
            return None
        return hit_rate(self.cached_tokens.total, self.prompt_tokens)

    @classmethod
    def from_finished(cls, event: RequestFinished) -> TurnStats:
        return cls(
            finish_reason=str(event.reason),
            prompt_tokens=event.prompt_tokens,
            cached_tokens=event.cached_tokens,
            prefilled_tokens=event.prefilled_tokens,
            recomputed_tokens=event.recomputed_tokens,
            generated_tokens=event.generated_tokens,
            ttft_s=event.ttft_s,
            decode_tok_s=event.decode_tok_s,
            error=event.error,
            draft_tokens=event.draft_tokens,
        )

    @classmethod
    def failed(cls, message: str) -> TurnStats:
        """A reply that never reached the engine (submit raised)."""
        return cls(str(FinishReason.ERROR), 0, CachedTokens(), 0, 0, 0, None, None, message)

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out

    @classmethod
    def from_json(cls, data: dict[str, object]) -> TurnStats:
        values = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        values["cached_tokens"] = CachedTokens(**dict(values.get("cached_tokens") or {}))  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]


@dataclass
class Message:
    """One message; `offset` is where its rendering starts in the session's ids (None: unknown)."""

    id: str
    role: str
    content: str
    state: MessageState = MessageState.COMPLETE
    offset: int | None = None
    ended_with_stop: bool = False  # assistant: its generated ids end with a stop token
    in_context: bool = True  # False once dropped from the model's context by overflow
    stats: TurnStats | None = None
    created: float = 0.0

    def as_chat(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def new_message(role: str, content: str, state: MessageState = MessageState.COMPLETE) -> Message:
    """A message with a fresh id, created now."""
    return Message(
        id=uuid.uuid4().hex, role=role, content=content, state=state, created=time.time()
    )


@dataclass
class Session:
    """A conversation: messages, their rendered ids (for `model_fingerprint`), its settings.

    Invariant: unless `ids_stale`, `ids` is exactly the rendering of the in-context
    messages (the last one's generated ids included), so the next turn appends.
    """

    id: str
    title: str
    created: float
    updated: float
    model_fingerprint: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: the service's default
    archived: bool = False
    deleted_at: float | None = None
    messages: list[Message] = field(default_factory=list)
    ids: array = field(default_factory=lambda: array("I"))
    ids_stale: bool = False  # True: render from messages at the next turn (other model, edit)
    number: int = 0  # its place in the list (alt+N), kept for its life (`session_numbers`)
    unsent: str = ""  # the composer's text for this session, typed and not sent
    model_name: str = ""  # the model its last turn ran on, as it was asked for ("": unknown)

    @property
    def system_prompt(self) -> str | None:
        if self.messages and self.messages[0].role == "system":
            return self.messages[0].content
        return None

    def context_messages(self) -> list[Message]:
        return [m for m in self.messages if m.in_context]

    def turn_count(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")


@dataclass(frozen=True)
class MessageView:
    id: str
    index: int
    role: str
    content: str
    state: MessageState
    in_context: bool
    stats: TurnStats | None


@dataclass(frozen=True)
class SessionView:
    """What a UI shows about one session; a snapshot, safe to keep."""

    id: str
    title: str
    state: TurnState
    archived: bool
    unread: bool
    queued_says: int  # says waiting for the current reply to end
    message_count: int
    context_tokens: int | None  # None: will be rendered again at the next turn
    context_length: int
    last_turn: TurnStats | None
    system_prompt: str | None
    sampling: SamplingParams
    max_tokens: int
    model_fingerprint: str
    notice: str | None  # e.g. "rendered for another model: will be computed again"
    created: float
    updated: float
    number: int  # its place in the list, from 1 (alt+N): never changes while it is listed
    unsent: str  # what was typed for it and not sent (its composer's text)
    model_name: str = ""  # the model its last turn ran on ("": unknown)
    # the service's count of views taken when this one was: of two views of a session,
    # the one with the larger count is the newer (not part of what is shown)
    taken: int = field(default=0, compare=False)

    @property
    def context_fraction(self) -> float | None:
        if self.context_tokens is None or self.context_length <= 0:
            return None
        return self.context_tokens / self.context_length


@dataclass(frozen=True)
class SessionSnapshot:
    """A session's view and messages taken together under the service's lock: what an
    event announces, so that a subscriber shows it without asking the service again."""

    view: SessionView
    messages: tuple[MessageView, ...]

    @property
    def taken(self) -> int:
        return self.view.taken


def sampling_to_json(sampling: SamplingParams) -> str:
    return json.dumps(asdict(sampling))


def sampling_from_json(text: str | None) -> SamplingParams:
    if not text:
        return SamplingParams()
    data = json.loads(text)
    return SamplingParams(
        **{k: v for k, v in data.items() if k in SamplingParams.__dataclass_fields__}
    )


def session_markdown(session: Session) -> str:
    """The conversation as Markdown, for export (what the user saw, dropped turns included)."""
    lines = [f"# {session.title}", ""]
    for message in session.messages:
        heading = {"system": "System", "user": "User", "assistant": "Assistant"}.get(
            message.role, message.role.title()
        )
        note = "" if message.state == MessageState.COMPLETE else f" _({message.state})_"
        lines += [f"## {heading}{note}", "", message.content, ""]
    return "\n".join(lines).rstrip() + "\n"
