"""The type-ahead pacer: chunks beside streams kept within a step-time allowance, or none at all."""

from __future__ import annotations

from collections.abc import Callable

from kvchat.engine.type_ahead_pacer import FORGET_AFTER, LIMIT, REFRESH_EVERY, TypeAheadPacer

DECODE = 0.020  # a decode-only step, seconds


def drive(pacer: TypeAheadPacer, cost: Callable[[int], float], steps: int) -> list[int]:
    """Chunks the pacer gives when a step carrying n type-ahead tokens takes `cost(n)` seconds."""
    chunks = []
    for _ in range(steps):
        n = pacer.chunk(DECODE)
        chunks.append(n)
        if n:
            pacer.observe(cost(n), DECODE, n)
    return chunks


def linear(per_token: float) -> Callable[[int], float]:
    return lambda n: DECODE + n * per_token


def test_no_type_ahead_beside_streams_before_their_pace_is_known() -> None:
    assert TypeAheadPacer().chunk(None) == 0


def test_cheap_tokens_grow_the_chunk_by_doubling_then_settle_below_the_limit() -> None:
    pacer = TypeAheadPacer()
    chunks = drive(pacer, linear(0.0001), steps=60)  # 1.05x at 10 tokens, 1.10x at 20
    assert [n for n in chunks if n][:5] == [1, 2, 4, 8, 16]
    late = [n for n in chunks[30:] if n]
    assert late and all(8 <= n < 20 for n in late)


def test_a_decode_only_step_comes_now_and_then() -> None:
    chunks = drive(TypeAheadPacer(), linear(0.0001), steps=4 * REFRESH_EVERY)
    assert chunks.count(0) >= 4


def test_one_token_rides_along_when_two_take_the_prefill_path() -> None:
    # one type-ahead token is one more decode row; two are a prefill run costing 3x a step
    pacer = TypeAheadPacer()
    chunks = drive(pacer, lambda n: DECODE * (1.02 if n == 1 else 3.0), steps=3 * FORGET_AFTER)
    over = sum(1 for n in chunks if n >= 2)
    assert over <= 4  # retried once per FORGET_AFTER steps: too rare for a p99 to see
    assert chunks.count(1) > 0.8 * len(chunks)


def test_tokens_costlier_than_the_limit_wait_and_are_retried_rarely() -> None:
    pacer = TypeAheadPacer()
    chunks = drive(pacer, lambda n: DECODE * (LIMIT + 0.2), steps=3 * FORGET_AFTER)
    carried = sum(1 for n in chunks if n)
    assert 1 <= carried <= 4
    assert carried / len(chunks) < 0.01


def test_a_chunk_that_became_too_large_shrinks() -> None:
    pacer = TypeAheadPacer()
    drive(pacer, linear(0.0001), steps=40)
    assert pacer.good >= 8
    chunks = drive(pacer, linear(0.001), steps=40)  # the context grew: 10x the cost a token
    assert max(chunks[-20:]) <= 2
