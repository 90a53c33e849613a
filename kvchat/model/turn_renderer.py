"""Conversation -> prompt ids, and the ids a new turn appends ("never re-tokenize history").

A session keeps the exact ids the model has already seen: the previous prompt
plus the reply it generated. Re-rendering and re-tokenizing the whole history
each turn could give different ids for the same text (a reply tokenized
differently from how it was generated, a BOS added twice, a template that
re-renders earlier turns) and then the KV cache would miss its own prefix. So
the next prompt is `stored ids + continuation_ids(...)`: only the text the
template adds after the stored part is tokenized.

How the continuation is found, by text:
1. Render the history with a sentinel in place of the last assistant reply: the
   text before the sentinel is what the previous prompt covered (checked against
   the rendering of the history before the reply with the generation prompt).
2. The stored ids cover that text, plus the reply, plus the end-of-turn token's
   text (`<|im_end|>`, `<|eot_id|>`) when the reply ended on it.
3. Render history + new messages with the generation prompt; if it starts with
   the covered text, tokenize the rest. That rest begins at a template boundary
   (usually a special token), so tokenizing it alone is what tokenizing the whole
   would give there.

Templates that cannot be appended to: those whose rendering of earlier turns
changes when turns are added, e.g. Qwen3 and DeepSeek-R1 style templates that
strip the reasoning (`<think>...</think>`) from assistant turns once they are no
longer the last one, or templates that move a date or a running count into the
system prompt. For them (and when the reply ended on a stop token the template
does not write, or its content was trimmed by the template), `continuation_ids`
returns None and the caller renders the whole conversation with `prompt_ids`.
Nothing breaks: the KV cache still reuses the longest common prefix of the old
and new ids (the system prompt and every turn before the first rewritten one).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from kvchat.model.chat_template import ChatTemplate, Message
from kvchat.model.tokenizer import Tokenizer

# Stands in for the last reply's content while locating it in the rendering.
# Private-use characters: no real reply contains them, and `trim` leaves them alone.
_SENTINEL = "\ue000kvchat-reply\ue001"
# Stands in for a type-ahead's user text: the rendering is cut where it starts.
_TYPE_AHEAD_SENTINEL = "\ue000kvchat-type-ahead\ue001"


class TurnRenderer:
    """Builds prompt ids from messages with a model's tokenizer and chat template."""

    renders_locally = True  # no I/O: a turn may be sized on the caller's thread

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The whole conversation with the generation prompt, as ids.

        The BOS id is prepended when the tokenizer asks for one and the template
        did not already write the BOS token's text (Llama 3 templates do).
        """
        text = self.template.render(messages, add_generation_prompt=True)
        return self._with_bos(text, self.tokenizer.encode(text, special=True))

    def continuation_ids(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        """The ids to append to a session's stored ids for `new_messages`, or None.

        The stored ids must be exactly the prompt that produced the last reply in
        `history` plus that reply's generated ids, whose decoded text (stop token
        skipped) is the reply's content. `reply_ended_with_stop` says the
        generated ids end with the end-of-turn token; `stop_token_id` names it
        when known, else it is taken to be the stop token the template writes
        right after the reply.

        An empty history, or one not ending with an assistant reply (only a system
        message), means nothing is stored yet: the result is `prompt_ids` of the
        whole conversation. None means the template rewrites history (see the
        module docstring): call `prompt_ids(history + new_messages)` instead and
        let the KV cache reuse the common prefix.
        """
        if not history or history[-1].get("role") != "assistant":
            return self.prompt_ids([*history, *new_messages])
        rest = self._continuation_text(history, new_messages, reply_ended_with_stop, stop_token_id)
        return None if rest is None else self.tokenizer.encode(rest, special=True)

    def type_ahead_ids(
        self,
        history: Sequence[Message],
        user_text: str,
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        """What a user message still being typed adds, up to the end of its text.

        The ids `continuation_ids(history, [user message])` (or `prompt_ids` when
        nothing is stored) would give, cut where the user's text ends: the template's
        closing tokens and the generation prompt are left out, so the submitted turn
        extends them. Only the last few ids may differ from the turn's once more text
        follows (a word tokenizes differently when it grows); the KV cache matches
        them token by token and recomputes from the first that differs. None when
        the template cannot be appended to, or moves or rewrites the user's text.
        """
        typed = [{"role": "user", "content": _TYPE_AHEAD_SENTINEL}]
        if not history or history[-1].get("role") != "assistant":
            text = self.template.render([*history, *typed], add_generation_prompt=True)
            head = _before_sentinel(text)
            if head is None:
                return None
            ids = self.tokenizer.encode(head + user_text, special=True)
            return self._with_bos(text, ids)
        rest = self._continuation_text(history, typed, reply_ended_with_stop, stop_token_id)
        head = None if rest is None else _before_sentinel(rest)
        if head is None:
            return None
        return self.tokenizer.encode(head + user_text, special=True)

    def _continuation_text(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        reply_ended_with_stop: bool,
        stop_token_id: int | None,
    ) -> str | None:
        """The text the template writes after the stored ids for `new_messages`, or None."""
        now = datetime.now()
        reply = history[-1].get("content", "")
        marked = [*history[:-1], {**history[-1], "content": _SENTINEL}]
        marked_text = self.template.render(marked, add_generation_prompt=False, now=now)
        if marked_text.count(_SENTINEL) != 1:
            return None
        before, after = marked_text.split(_SENTINEL)
        previous_prompt = self.template.render(history[:-1], add_generation_prompt=True, now=now)
        if previous_prompt != before:
            return None  # the stored prompt is not what the template writes before a reply

        covered = before + reply
        if reply_ended_with_stop:
            end_text = self._end_of_turn_text(after, stop_token_id)
            if end_text is None:
                return None
            covered += end_text

        full = self.template.render([*history, *new_messages], add_generation_prompt=True, now=now)
        if not full.startswith(covered):
            return None
        return full[len(covered) :]

    def _end_of_turn_text(self, after_reply: str, stop_token_id: int | None) -> str | None:
        """The text of the stop token that ended the reply, if the template writes it."""
        if stop_token_id is not None:
            return self.tokenizer.decode([stop_token_id])
        candidates = [
            self.tokenizer.decode([token_id]) for token_id in self.tokenizer.stop_token_ids
        ]
        matching = [text for text in candidates if text and after_reply.startswith(text)]
        return max(matching, key=len) if matching else None

    def _with_bos(self, text: str, ids: list[int]) -> list[int]:
        tokenizer = self.tokenizer
        bos_id = tokenizer.bos_token_id
        if not tokenizer.add_bos_token or bos_id is None:
            return ids
        if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
            return ids
        return [bos_id, *ids]


def _before_sentinel(text: str) -> str | None:
    """The text before the type-ahead sentinel; None unless it appears once, unchanged."""
    if text.count(_TYPE_AHEAD_SENTINEL) != 1:
        return None
    return text.split(_TYPE_AHEAD_SENTINEL)[0]
