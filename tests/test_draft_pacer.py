"""The draft pacer: chunks beside streams sized to a step-time allowance, or none at all."""

from __future__ import annotations

from kvchat.engine.draft_pacer import PROBE_EVERY, REFRESH_EVERY, DraftPacer

DECODE = 0.020  # a decode-only step, seconds


def drive(pacer: DraftPacer, per_token: float, steps: int) -> list[int]:
    """Chunks the pacer gives when each draft token costs `per_token` on top of a decode."""
    chunks = []
    for _ in range(steps):
        n = pacer.chunk(DECODE)
        chunks.append(n)
        if n:
            pacer.observe(DECODE + n * per_token, DECODE, n)
    return chunks


def test_no_draft_beside_streams_before_their_pace_is_known() -> None:
    assert DraftPacer().chunk(None) == 0


def test_cheap_tokens_grow_the_chunk_by_doubling_up_to_the_allowance() -> None:
    pacer = DraftPacer(slowdown=1.05)
    chunks = drive(pacer, per_token=0.0001, steps=40)  # allowance: 1 ms, 10 tokens
    growing = [n for n in chunks if n][:5]
    assert growing == [1, 2, 4, 8, 10]
    assert max(chunks) == 10
    # every step that carried a draft kept to the allowance
    assert all(DECODE + n * 0.0001 <= 1.05 * DECODE + 1e-12 for n in chunks)


def test_a_decode_only_step_comes_now_and_then() -> None:
    chunks = drive(DraftPacer(), per_token=0.0001, steps=4 * REFRESH_EVERY)
    assert chunks.count(0) >= 4


def test_tokens_costlier_than_the_allowance_wait_and_are_probed_rarely() -> None:
    pacer = DraftPacer(slowdown=1.05)
    chunks = drive(pacer, per_token=0.005, steps=3 * PROBE_EVERY)  # 1 token: 1.25x
    carried = [n for n in chunks if n]
    assert carried and set(carried) == {1}
    assert len(carried) <= 1 + 3 * PROBE_EVERY // (PROBE_EVERY - 1)
    assert sum(1 for n in chunks if n) / len(chunks) < 0.01  # too rare for a p99 to see


def test_a_machine_that_became_faster_is_seen_at_the_next_probe() -> None:
    pacer = DraftPacer(slowdown=1.05)
    drive(pacer, per_token=0.005, steps=PROBE_EVERY + 20)
    assert pacer.chunk(DECODE) in (0, 1)
    chunks = drive(pacer, per_token=0.0001, steps=2 * PROBE_EVERY)
    assert max(chunks) >= 8
