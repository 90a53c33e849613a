"""How many draft tokens a step may carry beside running streams, learned from step times.

A draft is a guess at a prompt the user has not sent yet, so the streams must not
pay for it: a step that carries a draft chunk beside decodes may take at most
`DRAFT_STEP_SLOWDOWN` times a decode-only step, so the streams' inter-token
latency rises by at most that much however many steps carry drafts (a percentile
can only move when the slow steps are common, and here every one is bounded).

The cost of a chunk is modelled as linear in its length: `per_token` is a moving
average of (draft step - decode step) / chunk, and the chunk is the most tokens
that fit in the allowed extra time. When even one token costs more (a slow machine,
a long context to attend to, the bookkeeping of a step), drafts wait while streams
run, and one token is tried again only every `PROBE_EVERY` decode steps (a probe's
cost replaces the average: the machine may have changed), so those probes are too
rare to show in a 99th percentile. A chunk grows at most twice as large as the last
one that kept to the allowance, so a cost fitted on small chunks is never trusted far.
"""

from __future__ import annotations

# A draft step may take this many times a decode-only step (drafts may cost the streams'
# p99 at most 10%; half of that is left to the machine's noise).
DRAFT_STEP_SLOWDOWN = 1.05
AVERAGE_WEIGHT = 0.25  # of the newest draft step in the per-token cost's moving average
PROBE_EVERY = 200  # decode-only steps between one-token probes while drafts are held back
MAX_CHUNK = 256
MIN_PER_TOKEN_S = 1e-6  # a step timed faster than the average decode says nothing of the cost
REFRESH_EVERY = 8  # every this many decode steps, one carries no draft (see `chunk`)


class DraftPacer:
    def __init__(self, slowdown: float = DRAFT_STEP_SLOWDOWN) -> None:
        self.slowdown = slowdown
        self.per_token_s: float | None = None  # None until a draft step beside streams was seen
        self._since_probe = 0
        self._steps = 0
        self._cap = 1  # the largest chunk the steps seen so far allow trying
        self._probing = False

    def chunk(self, decode_step_s: float | None) -> int:
        """Draft tokens the next decode step may carry (0: drafts wait this step)."""
        if decode_step_s is None:
            return 0  # the streams' own pace is not known yet
        self._steps += 1
        if self._steps % REFRESH_EVERY == 0:
            return 0  # a decode-only step now and then keeps the streams' own pace current
        if self.per_token_s is None:
            return 1
        allowed = (self.slowdown - 1.0) * decode_step_s
        n = min(int(allowed / max(self.per_token_s, MIN_PER_TOKEN_S)), self._cap)
        if n >= 1:
            return n
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            self._probing = True
            return 1
        return 0

    def observe(self, seconds: float, decode_step_s: float | None, tokens: int) -> None:
        """Account one step that carried `tokens` draft tokens beside decodes."""
        if decode_step_s is None or tokens <= 0:
            return
        cost = max(0.0, seconds - decode_step_s) / tokens
        if self.per_token_s is None or self._probing:  # a probe measures afresh
            self._probing = False
            self.per_token_s = cost
        else:
            self.per_token_s += AVERAGE_WEIGHT * (cost - self.per_token_s)
        # grow the chunk only from one that kept to the allowance (a cost model fitted on
        # small chunks must not jump to a large one at once)
        if seconds <= self.slowdown * decode_step_s:
            self._cap = min(MAX_CHUNK, max(self._cap, 2 * tokens))
        else:
            self._cap = max(1, tokens // 2)
