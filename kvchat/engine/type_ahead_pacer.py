"""How many type-ahead tokens a step may carry beside running streams, learned from step times.

A type-ahead is a guess at a prompt the user has not sent yet, so the streams must not
pay for it: a step that carries a type-ahead chunk beside decodes should take at most
`TARGET` times a decode-only step, and one that takes more than `LIMIT` times it
counts as a failure. The streams' inter-token latency then rises by at most that much
however many steps carry type-aheads (a percentile moves only when slow steps are common).

Why not a cost model linear in the chunk's length: the cost is not linear. A
one-token chunk beside decodes is one more decode row; from two tokens on, the chunk
is a prefill run, which takes the attention's prefill path and, past a few rows, the
linears' dense path, so a step can cost several times a decode step at once. So the
pacer searches: it remembers the largest chunk seen within the target (`good`) and
the smallest seen over the limit (`bad`), doubles `good` while nothing is known above
it, then tries between the two. A `bad` is forgotten after `FORGET_AFTER` decode
steps (the context, the streams or the machine change), so at most one step in that
many exceeds the limit, too few to show in a 99th percentile. When even one token
exceeds it, type-aheads wait while streams run until the next such retry.
"""

from __future__ import annotations

# A type-ahead step should take at most this many times a decode-only step, and one that
# takes more than LIMIT times counts as too large (the bar is 10% on the streams' p99).
TARGET = 1.05
LIMIT = 1.10
FORGET_AFTER = 200  # decode steps after which a chunk found too large is tried again
MAX_CHUNK = 256
REFRESH_EVERY = 8  # every this many decode steps, one carries no type-ahead (see `chunk`)


class TypeAheadPacer:
    def __init__(self, target: float = TARGET, limit: float = LIMIT) -> None:
        self.target = target
        self.limit = limit
        self.good = 0  # the largest chunk seen within the target
        self.bad: int | None = None  # the smallest chunk seen over the limit, until forgotten
        self._bad_age = 0
        self._steps = 0

    def chunk(self, decode_step_s: float | None) -> int:
        """Type-ahead tokens the next decode step may carry (0: type-aheads wait this step)."""
        if decode_step_s is None:
            return 0  # the streams' own pace is not known yet
        self._steps += 1
        if self.bad is not None:
            self._bad_age += 1
            if self._bad_age >= FORGET_AFTER:
                self.bad = None
        if self._steps % REFRESH_EVERY == 0:
            return 0  # a decode-only step now and then keeps the streams' own pace current
        if self.bad is None:
            return min(MAX_CHUNK, max(1, 2 * self.good))
        if self.good == 0:
            return 0  # even one token was too much: wait until it is tried again
        return max(self.good, min(2 * self.good, (self.good + self.bad) // 2))

    def observe(self, seconds: float, decode_step_s: float | None, tokens: int) -> None:
        """Account one step that carried `tokens` type-ahead tokens beside decodes."""
        if decode_step_s is None or decode_step_s <= 0 or tokens <= 0:
            return
        ratio = seconds / decode_step_s
        if ratio <= self.target:
            self.good = max(self.good, tokens)
            if self.bad is not None and self.bad <= self.good:
                self.bad = None  # it was noise, or the cost fell
        elif ratio > self.limit:
            self.bad = tokens if self.bad is None else min(self.bad, tokens)
            self._bad_age = 0
            if self.good >= tokens:
                self.good = tokens // 2  # what looked good is not (the context grew)
