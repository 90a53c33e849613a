"""A request's text as it streams: each sampled token through the request's detokenizer,
then through its stop strings.

The detokenizer never splits a UTF-8 character (it holds back an incomplete one); the
last token of a request flushes whatever it held. A stop string may arrive split over
several tokens, so the text that might be its start is held back
(`Sequence.pending_text`) until the next token says whether it was one; the stop string
itself is never emitted.
"""

from __future__ import annotations

from kvchat.engine.sequence import Sequence


def token_text(seq: Sequence, token: int, *, final: bool) -> tuple[str, bool]:
    """The text `token` adds to the request's reply now, and whether a stop string ended it."""
    delta = seq.detokenizer.push([token])
    if final:
        delta += seq.detokenizer.flush()
    return apply_stop_strings(seq, delta, final=final)


def apply_stop_strings(seq: Sequence, delta: str, *, final: bool) -> tuple[str, bool]:
    """Text to emit now, and whether a stop string ended the request.

    Holds back a tail that might be the start of a stop string.
    """
    stops = seq.request.stop_strings
    if not stops:
        return delta, False
    pending = seq.pending_text + delta
    for stop in stops:
        at = (seq.text[-len(stop) :] + pending).find(stop) if stop else -1
        if at >= 0:
            cut = max(0, at - min(len(stop), len(seq.text)))
            seq.pending_text = ""
            return pending[:cut], True
    if final:
        seq.pending_text = ""
        return pending, False
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(pending)), 0, -1):
            if pending.endswith(stop[:k]):
                hold = max(hold, k)
                break
    seq.pending_text = pending[len(pending) - hold :] if hold else ""
    return pending[: len(pending) - hold], False
