"""Streaming ids -> text deltas that never split a UTF-8 character.

Decoding one token at a time is wrong twice over: a byte-level BPE token can
hold part of a character (an emoji is often two or three tokens, and each alone
decodes to U+FFFD), and SentencePiece-style decoders drop the leading space of
the first token they see, so "▁world" alone decodes to "world". Decoding the
whole sequence on every token is right but costs O(n) per token.

The usual fix (text-generation-inference, vLLM): keep two offsets into the ids.
`prefix` starts a short window of already-emitted tokens that gives the decoder
its context (so a stripped leading space is stripped on both sides of the diff);
`read` is where the emitted text ends. Each push decodes `ids[prefix:read]` and
`ids[prefix:]` and emits the difference. When the latter ends in U+FFFD (a
character still missing bytes) it backs off up to 3 tokens to the last boundary
where the text is complete, emits up to there and keeps the rest pending. After
an emission the window slides forward, so each decode covers only a few tokens:
O(1) amortized per token. Ids before the window are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# An incomplete character is at most 3 bytes, and every byte-level or byte-fallback
# token carries at least one byte, so its bytes sit in the last 3 tokens at most:
# backing off that far finds the end of the complete text.
_MAX_INCOMPLETE_TOKENS = 3

# Holding more tokens than this means the model really produced invalid UTF-8: emit
# it as U+FFFD (as a full decode would) rather than let the window grow without bound.
_MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas; one per request."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        # skip_special: leave special tokens (the stop token `<|im_end|>`) out of the text.
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids: list[int] = []  # the window: the stream's ids from the prefix offset on
        self._read = 0  # index in self._ids where the emitted text ends
        self._prefix_text: str | None = None  # decode of self._ids[:self._read], cached

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the text that is now complete (maybe "")."""
        self._ids.extend(ids)
        prefix_text = self._prefix()
        end = len(self._ids)
        # Find the last token boundary where the text ends on a complete character:
        # usually the end itself; up to 3 tokens back when a character is still open.
        lowest = max(self._read + 1, end - _MAX_INCOMPLETE_TOKENS)
        for stop in range(end, lowest - 1, -1):
            text = self._decode(self._ids[:stop])
            if not text.endswith(_REPLACEMENT):
                if len(text) > len(prefix_text):
                    return self._emit(text[len(prefix_text) :], stop)
                break  # nothing visible yet (a skipped special token, a held space)
        if end - self._read > _MAX_PENDING_TOKENS:
            return self._emit(self._decode(self._ids)[len(prefix_text) :], end)
        return ""

    def flush(self) -> str:
        """The text still held back at the end of the stream (may hold U+FFFD)."""
        rest = self._decode(self._ids)[len(self._prefix()) :]
        self._ids.clear()
        self._read = 0
        self._prefix_text = None
        return rest

    def _emit(self, delta: str, stop: int) -> str:
        # Slide: the tokens just emitted become the next decode's context; older ones go.
        del self._ids[: self._read]
        self._read = stop - self._read
        self._prefix_text = None
        return delta

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        return self._prefix_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special=self._skip_special)
