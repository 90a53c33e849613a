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


class StepPacer:
    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.scale = 1.0
        self.decode_step_s: float | None = None  # moving average, None until one was seen

    def observe(self, kind: StepKind, seconds: float) -> None:
        """Account one finished step."""
        if kind is StepKind.DECODE:
            if self.decode_step_s is None:
                self.decode_step_s = seconds
            else:
                self.decode_step_s += AVERAGE_WEIGHT * (seconds - self.decode_step_s)
        elif kind is StepKind.MIXED and self.decode_step_s is not None and seconds > 0:
            target = self.slowdown * self.decode_step_s
            change = min(MAX_CHANGE, max(1 / MAX_CHANGE, (target / seconds) ** RESPONSE))
            self.scale = min(MAX_SCALE, max(MIN_SCALE, self.scale * change))
