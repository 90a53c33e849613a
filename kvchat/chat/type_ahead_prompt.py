"""A session's type-ahead: its unsent message, rendered as its turn will be and computed ahead.

While the user types (or after a paste), the text so far is rendered exactly as
`say` would render it (the stored ids plus the template's continuation) up to the
end of the user's text, and the engine computes it at the lowest priority. When
the message is sent, its prompt extends the type-ahead's ids, so the turn finds those
pages in the cache and computes only what came after (and the last few tokens, if
a word that grew tokenizes differently).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.chat.engine_port import RendererPort
from kvchat.chat.session import Session


@dataclass
class SessionTypeAhead:
    """The engine type-ahead of one session, and text waiting for the session's reply to end."""

    request_id: int | None = None  # the engine's id for it; None: none running
    ids: tuple[int, ...] = ()
    ready: int = 0  # tokens of `ids` computed (or found cached), as the engine last said
    pending: str | None = None  # typed while a reply runs: submitted once it ends

    def clear(self) -> None:
        self.request_id, self.ids, self.ready, self.pending = None, (), 0, None


def type_ahead_prompt(
    session: Session,
    renderer: RendererPort,
    text: str,
    *,
    context_length: int,
    max_tokens: int,
) -> tuple[int, ...] | None:
    """The ids `say(text)` would submit, cut at the end of `text`; None when it cannot be
    computed ahead.

    It cannot be when the stored ids are stale (the turn renders everything again), the
    template rewrites history, or the turn would overflow the context (it would then
    drop old turns and change the prefix).
    """
    context = session.context_messages()
    history = [m.as_chat() for m in context]
    after_reply = bool(context) and context[-1].role == "assistant"
    if session.ids_stale:
        return None
    if len(session.ids) > 0 and after_reply:
        last = context[-1]
        cont = renderer.type_ahead_ids(
            history,
            text,
            reply_ended_with_stop=last.ended_with_stop,
            stop_token_id=session.ids[-1] if last.ended_with_stop else None,
        )
        ids = None if cont is None else (*session.ids, *cont)
    elif len(session.ids) == 0 and not after_reply:
        whole = renderer.type_ahead_ids(history, text, reply_ended_with_stop=False)
        ids = None if whole is None else tuple(whole)
    else:
        return None
    if ids is None or len(ids) + min(max_tokens, context_length // 4) > context_length:
        return None
    return ids
