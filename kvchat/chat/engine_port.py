"""What the chat layer needs from the engine and the chat template, as Protocols.

`kvchat/chat/` must not import torch or the engine's internals: it talks to the
engine only through `EnginePort`, whose values come from `kvchat.engine.api`, and
renders turns only through `RendererPort`.
Tests substitute fakes (`tests/fake_engine.py`) for both, and the CLI wires the
real `Engine` and `TurnRenderer` in through a `ChatBackend`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvchat.engine.api import DraftProgress, EngineEvent, EngineStats, GenerationRequest, Residency

Message = Mapping[str, str]  # {"role": ..., "content": ...}


class EnginePort(Protocol):
    """The engine as the chat layer sees it; every method is safe from any thread."""

    def submit(self, request: GenerationRequest, on_event: Callable[[EngineEvent], None]) -> int:
        """Queue a request; `on_event` is called from the engine thread. Returns its id."""
        ...

    def cancel(self, request_id: int) -> None: ...

    def draft(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[DraftProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """Compute a prompt ahead at the lowest priority (type-ahead); `cancel` ends it.

        `replaces` names a draft this one takes over from (cancelled; its pages stay).
        """
        ...

    def prefetch(self, token_ids: Sequence[int]) -> None: ...

    def residency(self, token_ids: Sequence[int]) -> Residency: ...

    def stats(self) -> EngineStats: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def context_length(self) -> int: ...


class RendererPort(Protocol):
    """The chat template, rendering whole conversations or only what a turn adds."""

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

    def draft_ids(
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

    engine: EnginePort
    renderer: RendererPort
    stop_token_ids: frozenset[int] = frozenset()  # the tokenizer's end-of-turn ids
