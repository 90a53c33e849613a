"""Planning a turn's prompt: pure functions over a session's messages and stored ids.

The next prompt is the stored ids plus the renderer's continuation, never a
re-render of old turns, unless the model changed, an edit cut the ids at its
point (`cut_ids`), or the template rewrites earlier turns. When the prompt would
overflow the context, the oldest turns after the system prompt are dropped in one
step of at least a third of the context (`drop_oldest_turns`), so the prefix the
cache matched changes rarely. Nothing here touches the engine, the store or a lock.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from kvchat.chat.engine_port import RendererPort
from kvchat.chat.session import Message, Session
from kvchat.errors import PromptTooLongError


@dataclass(frozen=True)
class PromptPlan:
    """A turn's prompt ids, where the new message starts in them, and what was dropped."""

    prompt: list[int]
    new_offset: int | None
    full_render: bool
    dropped: tuple[Message, ...] = ()


def cut_ids(session: Session, k: int, at: Message | None = None) -> bool:
    """Keep the ids before message k's rendering; False when its offset is unknown."""
    message = at or (session.messages[k] if k < len(session.messages) else None)
    if (
        message is not None
        and message.offset is not None
        and message.in_context
        and not session.ids_stale
    ):
        del session.ids[message.offset :]
        return True
    session.ids = array("I")
    session.ids_stale = True
    return False


def plan_prompt(
    session: Session,
    new: Message,
    max_tokens: int,
    renderer: RendererPort,
    context_length: int,
) -> PromptPlan:
    """The prompt for `new`: stored ids + continuation, or a render, fitted to the context."""
    context = session.context_messages()
    ctx_len = context_length
    reserve = reply_reserve(max_tokens, ctx_len)
    plan: PromptPlan | None = None
    if (
        not session.ids_stale
        and len(session.ids) > 0
        and context
        and context[-1].role == "assistant"
    ):
        cont = renderer.continuation_ids(
            [m.as_chat() for m in context],
            [new.as_chat()],
            reply_ended_with_stop=context[-1].ended_with_stop,
            stop_token_id=session.ids[-1] if context[-1].ended_with_stop else None,
        )
        if cont is not None:
            plan = PromptPlan(list(session.ids) + list(cont), len(session.ids), False)
    if plan is None:
        prompt = renderer.prompt_ids([m.as_chat() for m in [*context, new]])
        plan = PromptPlan(prompt, 0 if not context else None, True)
    if len(plan.prompt) + reserve <= ctx_len:
        return plan
    return drop_oldest_turns(renderer, context, new, len(plan.prompt), reserve, ctx_len)


def reply_reserve(max_tokens: int, context_length: int) -> int:
    """Tokens a prompt leaves for the reply: its max tokens, at most a quarter of the
    context (a huge max_tokens stops at the context's end instead)."""
    return min(max_tokens, context_length // 4)


def drop_oldest_turns(
    renderer: RendererPort,
    context: list[Message],
    new: Message,
    old_len: int,
    reserve: int,
    ctx_len: int,
) -> PromptPlan:
    """Drop whole turns after the system prompt, at least a third of the context at once."""
    head = context[:1] if context and context[0].role == "system" else []
    body = context[len(head) :]
    # a turn starts at a user message; cut candidates are the next turns' starts, then all
    cuts = [i for i, m in enumerate(body) if m.role == "user" and i > 0] + [len(body)]
    for cut in cuts:
        kept = [*head, *body[cut:], new]
        prompt = renderer.prompt_ids([m.as_chat() for m in kept])
        fits = len(prompt) + reserve <= ctx_len
        if fits and (old_len - len(prompt) >= ctx_len // 3 or cut == len(body)):
            return PromptPlan(prompt, 0 if len(kept) == 1 else None, True, tuple(body[:cut]))
    alone = len(renderer.prompt_ids([m.as_chat() for m in [*head, new]]))
    raise PromptTooLongError(
        f"this message is {alone:,} tokens and does not fit in the model's context of "
        f"{ctx_len:,} tokens with {reserve:,} kept for the reply: "
        f"{alone + reserve - ctx_len:,} tokens too many; shorten it or lower max_tokens"
    )


def reset_offsets(context: list[Message]) -> None:
    """After a full render only the first message's offset (0) is known."""
    for i, m in enumerate(context):
        m.offset = 0 if i == 0 else None
