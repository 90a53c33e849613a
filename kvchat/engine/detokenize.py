"""A sampled token's text: the request's detokenizer, then its stop strings.

The detokenizer never splits a UTF-8 character (it holds back an incomplete one);
the last token of a request flushes whatever it held.
"""

from __future__ import annotations

from kvchat.engine.sequence import Sequence
from kvchat.engine.stop_strings import apply_stop_strings


def token_text(seq: Sequence, token: int, *, final: bool) -> tuple[str, bool]:
    """The text `token` adds to the request's reply now, and whether a stop string ended it."""
    delta = seq.detokenizer.push([token])
    if final:
        delta += seq.detokenizer.flush()
    return apply_stop_strings(seq, delta, final=final)
