"""What the chat layer needs from an engine and a chat template, as Protocols.

`kvchat/chat/` must not import torch or the engine's internals. The session
layer hands a whole *turn* to a `TurnPort`: the conversation's messages, plus
the prompt ids it keeps for a backend that computes from ids (the embedded
engine, which finds the cached prefix in them). It gets back the engine events
of `kvchat.engine.api`: text deltas (`TokenGenerated`, whose ids may be
empty for a backend that sends text only) and the turn's figures
(`RequestFinished`, or `TurnFinished` when the backend reports counts rather
than ids). The embedded engine, a token-level `EnginePort`, becomes a
`TurnPort` through `EngineTurnAdapter`; a remote server implements `TurnPort`
directly (kvchat/remote/). Tests substitute fakes (`kvchat/testing/fake_engine.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvchat.engine.api import (
    EngineEvent,
    EngineStats,
    GenerationRequest,
    RequestFinished,
    Residency,
    SamplingParams,
    TypeAheadProgress,
)

Message = Mapping[str, str]  # {"role": ..., "content": ...}


@dataclass(frozen=True)
class Turn:
    """One reply to generate: what the session layer hands to a `TurnPort`."""

    session_id: str  # stable per conversation (a remote backend sends it for routing)
    messages: tuple[Message, ...]  # the in-context conversation, the new user message last
    prompt_ids: tuple[int, ...]  # the stored ids plus the continuation (the embedded prompt)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TurnFinished(RequestFinished):
    """A finished turn from a backend that reports counts, not ids (a remote server).

    `generated_ids` is empty; `generated_count` is the server's count. Figures the
    backend does not report are None (`cached_tokens.host`, `recomputed_tokens`, ...).
    `interrupted`: the stream broke after text had arrived (reason `error`); the text
    is the partial reply, which the session layer keeps as an interrupted message.
    """

    generated_count: int = 0
    interrupted: bool = False

    @property
    def generated_tokens(self) -> int:
        return self.generated_count


class EnginePort(Protocol):
    """A token-level engine (the embedded one); every method is safe from any thread."""

    def submit(self, request: GenerationRequest, on_event: Callable[[EngineEvent], None]) -> int:
        """Queue a request; `on_event` is called from the engine thread. Returns its id."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def type_ahead(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """Compute a prompt ahead at the lowest priority (type-ahead); `cancel` ends it.

        `replaces` names a type-ahead this one takes over from (cancelled; its pages stay).
        """
        ...

    def prefetch(self, token_ids: Sequence[int]) -> None: ...

    def residency(self, token_ids: Sequence[int]) -> Residency: ...

    def stats(self) -> EngineStats: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def context_length(self) -> int: ...


@runtime_checkable
class TurnPort(Protocol):
    """What the session layer calls: a turn in, its events out; safe from any thread."""

    streams_token_ids: bool  # False: text deltas only (their ids are unknown, not empty)

    def submit_turn(self, turn: Turn, on_event: Callable[[EngineEvent], None]) -> int:
        """Start the turn's reply; `on_event` is called from another thread. Returns its id."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def type_ahead(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """Compute a prompt ahead (type-ahead); a backend that cannot returns an id and does
        nothing. `cancel` ends it.

        `replaces` names a type-ahead this one takes over from (cancelled; its pages stay).
        """
        ...

    def prefetch(self, token_ids: Sequence[int]) -> None: ...

    def residency(self, token_ids: Sequence[int]) -> Residency: ...

    def stats(self) -> EngineStats: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def context_length(self) -> int: ...


class EngineTurnAdapter:
    """The embedded engine as a `TurnPort`: a turn's prompt ids become its request."""

    streams_token_ids = True  # its `TokenGenerated` events carry the reply's ids

    def __init__(self, engine: EnginePort) -> None:
        self.engine = engine

    def submit_turn(self, turn: Turn, on_event: Callable[[EngineEvent], None]) -> int:
        request = GenerationRequest(
            prompt_ids=turn.prompt_ids,
            sampling=turn.sampling,
            max_tokens=turn.max_tokens,
            stop_token_ids=turn.stop_token_ids,
            ignore_eos=turn.ignore_eos,
        )
        return self.engine.submit(request, on_event)

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)

    def type_ahead(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        return self.engine.type_ahead(token_ids, on_progress, replaces=replaces)

    def prefetch(self, token_ids: Sequence[int]) -> None:
        self.engine.prefetch(token_ids)

    def residency(self, token_ids: Sequence[int]) -> Residency:
        return self.engine.residency(token_ids)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def model_fingerprint(self) -> str:
        return self.engine.model_fingerprint

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def __getattr__(self, name: str):  # anything else the wrapped engine offers (close, ...)
        return getattr(self.engine, name)


def turn_port(engine: TurnPort | EnginePort) -> TurnPort:
    """`engine` as a `TurnPort` (a token-level engine is wrapped)."""
    if hasattr(engine, "submit_turn"):
        return engine  # type: ignore[return-value]
    return EngineTurnAdapter(engine)  # type: ignore[arg-type]


class RendererPort(Protocol):
    """The chat template, rendering whole conversations or only what a turn adds."""

    # True when rendering only computes in this process (no I/O): a turn's continuation
    # may then be sized on the caller's thread (`turn_planner.py`); a renderer without
    # the attribute is sized on the planner's
    renders_locally: bool

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The whole conversation plus the generation prompt."""
        ...

    def continuation_ids(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        """Ids to append to stored ids (prompt + generated) for `new_messages`.

        `stop_token_id` is the token that ended the last reply, when it ended on one.
        None when the template rewrites earlier turns: the caller renders it all.
        """
        ...

    def type_ahead_ids(
        self,
        history: Sequence[Message],
        user_text: str,
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        """What a user message still being typed adds, up to the end of its text.

        Like `continuation_ids` (the whole rendering when nothing is stored) for a
        user message of `user_text`, without the template's closing tokens.
        """
        ...


@dataclass(frozen=True)
class ChatBackend:
    """What the CLI hands to the chat layer and the headless mode: an engine and its template."""

    engine: TurnPort | EnginePort
    renderer: RendererPort
    stop_token_ids: frozenset[int] = frozenset()  # the tokenizer's end-of-turn ids
