"""How much prefill a step may carry beside running streams, learned from step times.

A stream's inter-token latency is the duration of the steps it is in. While a long
prompt is ingested, every step carries a prefill chunk beside the decodes, and that
chunk's cost depends on the machine, the model and the context it attends to (its
attention grows with chunk x context). A fixed chunk size is right for one machine at
one context length only: too large and the streams stutter, too small and the prompt
waits for nothing.

The pacer keeps the cost bounded by construction: it tracks how long a decode-only
step takes (a moving average) and scales the prefill allowance after each mixed step
so that mixed steps take about `slowdown` times that. The scheduler multiplies its
static caps (`prefill_tokens_while_decoding`, `prefill_work_while_decoding`) by
`scale`; the chunk never drops below `min_prefill_chunk`, so the prompt always moves.

A step with no stream in it is bounded in time too (`prefill_tokens`): a prompt from
another session that arrives during a long prefill waits for the step under way, so such
steps are sized from the measured seconds per prefilled token to take about
`prefill_step_s`, never fewer than `MIN_PREFILL_TOKENS` (big chunks cost less a token).
"""

from __future__ import annotations

from enum import Enum


class StepKind(Enum):
    DECODE = "decode"  # decodes only: the streams' own pace
    MIXED = "mixed"  # decodes and prefill chunks: paced
    PREFILL = "prefill"  # no stream to protect: not paced


MIN_SCALE = 1 / 16
MAX_SCALE = 4.0
AVERAGE_WEIGHT = 0.2  # of the newest decode-only step in the moving average
MAX_CHANGE = 1.5  # the scale moves at most this factor per mixed step (noise damping)
# Each mixed step moves the scale this fraction of the way to the one its timing asks for
# (in log terms: the square root of target / measured). A full correction chased every
# step's noise, and the slowest mixed steps, the streams' p99, sat well above the target
# (measured: docs/scheduler.md).
RESPONSE = 0.5
# a prefill-only step: never smaller than this (the matrix products' cost a row grows
# below it), the first one before any was measured this size (it measures the rate)
MIN_PREFILL_TOKENS = 256
PREFILL_WEIGHT = 0.5  # of the newest prefill-only step in the seconds-per-token average


class StepPacer:
    def __init__(self, slowdown: float, prefill_step_s: float = 0.0) -> None:
        self.slowdown = slowdown
        self.scale = 1.0
        self.decode_step_s: float | None = None  # moving average, None until one was seen
        self.prefill_step_s = prefill_step_s  # 0: prefill-only steps are not bounded
        self.prefill_token_s: float | None = None  # moving average, None until one was seen

    def prefill_tokens(self, budget: int) -> int:
        """The tokens a step with no stream in it may carry: `budget`, or fewer to end in
        about `prefill_step_s`."""
        if self.prefill_step_s <= 0:
            return budget
        if self.prefill_token_s is None:
            return min(budget, MIN_PREFILL_TOKENS)
        fits = int(self.prefill_step_s / self.prefill_token_s)
        return min(budget, max(MIN_PREFILL_TOKENS, fits))

    def observe(self, kind: StepKind, seconds: float, tokens: int = 0) -> None:
        """Account one finished step (`tokens`: all it computed, for a prefill-only one)."""
        if kind is StepKind.DECODE:
            if self.decode_step_s is None:
                self.decode_step_s = seconds
            else:
                self.decode_step_s += AVERAGE_WEIGHT * (seconds - self.decode_step_s)
        elif kind is StepKind.MIXED and self.decode_step_s is not None and seconds > 0:
            target = self.slowdown * self.decode_step_s
            change = min(MAX_CHANGE, max(1 / MAX_CHANGE, (target / seconds) ** RESPONSE))
            self.scale = min(MAX_SCALE, max(MIN_SCALE, self.scale * change))
        elif kind is StepKind.PREFILL and tokens >= MIN_PREFILL_TOKENS // 4 and seconds > 0:
            # short prompts are mostly fixed cost a step: they would overstate the rate
            per_token = seconds / tokens
            if self.prefill_token_s is None:
                self.prefill_token_s = per_token
            else:
                self.prefill_token_s += PREFILL_WEIGHT * (per_token - self.prefill_token_s)
