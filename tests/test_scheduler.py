"""The scheduler's step plans: decodes first, and prefill chunks sized to keep streams fast."""

from __future__ import annotations

from kvchat.engine.cache.page_hash import root_salt
from kvchat.engine.cache.page_table import PageTable
from kvchat.engine.config import EngineConfig
from kvchat.engine.request import GenerationRequest
from kvchat.engine.scheduler import Scheduler
from kvchat.engine.sequence import Sequence
from kvchat.engine.step_pacer import (
    MAX_SCALE,
    MIN_PREFILL_TOKENS,
    MIN_SCALE,
    StepKind,
    StepPacer,
)
from tests.page_table_helpers import FakeMover


class _NoText:
    """Stands in for the detokenizer: the scheduler never decodes text."""


def make_sequence(request_id: int, prompt: list[int]) -> Sequence:
    request = GenerationRequest(tuple(prompt), max_tokens=8)
    return Sequence(request_id, request, lambda _e: None, _NoText(), frozenset())  # type: ignore[arg-type]


def run_plan(scheduler: Scheduler) -> dict[int, int]:
    """Schedule one step and play the engine's part: mark the planned tokens computed."""
    plan = scheduler.schedule()
    for seq, n in plan.runs:
        seq.num_computed += n
        scheduler.table.commit(seq.id, seq.tokens[seq.num_computed - n : seq.num_computed])
        if seq.to_compute == 0:
            seq.tokens.append(1)  # the step's sampled token: now a decode
    return {seq.id: n for seq, n in plan.runs}


def make_scheduler(**config_fields) -> Scheduler:
    config = EngineConfig(**{"page_size": 16, "step_token_budget": 512, **config_fields})
    table = PageTable(1024, 16, root_salt("m", "float32", "native"), None, FakeMover(1024, 0, 16))
    return Scheduler(config, table, max_context=1 << 20)


def test_prefill_chunks_beside_streams_shrink_as_the_context_grows() -> None:
    scheduler = make_scheduler()
    config, table = scheduler.config, scheduler.table
    stream = make_sequence(1, [5, 6, 7])
    scheduler.add(stream)
    assert run_plan(scheduler) == {1: 3}
    long = make_sequence(2, list(range(100, 100 + 6000)))
    scheduler.add(long)
    chunks: list[int] = []
    while long.to_compute > 1:
        plan = run_plan(scheduler)
        assert plan[1] == 1  # the stream decodes every step
        chunks.append(plan.get(2, 0))
    cap = config.prefill_tokens_while_decoding
    assert chunks[0] == cap  # near the start of the prompt: the full chunk
    # every chunk's attention work (new tokens x context) stays bounded (or at the floor)
    done, work = 0, config.prefill_work_while_decoding
    for n in chunks:
        assert n <= cap
        assert n == config.min_prefill_chunk or n * max(1, done) <= work
        done += n
    assert chunks[-2] < cap // 4  # near 6k tokens of context: far smaller chunks
    table.validate()


def test_without_streams_and_a_time_bound_a_prompt_prefills_in_full_budget_chunks() -> None:
    scheduler = make_scheduler(prefill_step_s=0)
    long = make_sequence(2, list(range(100, 100 + 3000)))
    scheduler.add(long)
    chunks = []
    while long.to_compute > 1:
        chunks.append(run_plan(scheduler)[2])
    assert chunks[:5] == [512] * 5


def test_a_step_without_streams_is_sized_to_its_time_bound_from_the_measured_rate() -> None:
    """A prompt from another session waits for the step under way: a prefill-only step
    takes about `prefill_step_s`, however fast the machine prefills."""
    scheduler = make_scheduler(step_token_budget=3072, prefill_step_s=1.0)
    pacer = scheduler.pacer
    long = make_sequence(2, list(range(100, 100 + 9000)))
    scheduler.add(long)
    chunks = []
    for seconds_per_token in (1 / 1000, 1 / 1000, 1 / 500, 1 / 500, 1 / 500, 1 / 500):
        plan = scheduler.schedule()
        assert plan.kind is StepKind.PREFILL
        (seq, n), = plan.runs  # fmt: skip
        chunks.append(n)
        seq.num_computed += n
        scheduler.table.commit(seq.id, seq.tokens[seq.num_computed - n : seq.num_computed])
        pacer.observe(plan.kind, n * seconds_per_token, n)
    assert chunks[0] == MIN_PREFILL_TOKENS  # before any step was measured
    assert chunks[1] == chunks[2] == 1000  # 1 ms a token: a second's worth
    assert 1000 > chunks[3] > chunks[4] > chunks[5] > 500  # slower: smaller, step by step
    # a fast machine: up to the token budget; a slow one: never under the floor
    pacer.prefill_token_s = 1 / 1e6
    assert pacer.prefill_tokens(3072) == 3072
    pacer.prefill_token_s = 1.0
    assert pacer.prefill_tokens(3072) == MIN_PREFILL_TOKENS
    # a short prompt (mostly a step's fixed cost) does not count as the rate
    pacer.observe(StepKind.PREFILL, 0.05, 10)
    assert pacer.prefill_token_s == 1.0


def test_the_pacer_scales_chunks_and_steps_report_their_kind() -> None:
    scheduler = make_scheduler()
    config = scheduler.config
    stream = make_sequence(1, [5, 6, 7])
    scheduler.add(stream)
    run_plan(scheduler)
    assert scheduler.schedule().kind is StepKind.DECODE
    long = make_sequence(2, list(range(100, 100 + 2000)))
    scheduler.add(long)
    plan = scheduler.schedule()
    assert plan.kind is StepKind.MIXED
    assert dict((s.id, n) for s, n in plan.runs)[2] == config.prefill_tokens_while_decoding
    scheduler.pacer.scale = 0.25  # mixed steps took too long: a quarter of the allowance
    run_plan(scheduler)
    assert run_plan(scheduler)[2] == config.prefill_tokens_while_decoding // 4
    scheduler.pacer.scale = 1 / 16  # never below the floor: the prompt always moves
    assert run_plan(scheduler)[2] == config.min_prefill_chunk


def _paced_mixed_step_seconds(slowdown: float, decode_s: float, per_scale_s: float) -> float:
    """Drive a pacer against a step-cost model: decode part plus a chunk cost ~ scale."""
    pacer = StepPacer(slowdown)
    mixed = 0.0
    for _ in range(60):
        pacer.observe(StepKind.DECODE, decode_s)
        mixed = decode_s + per_scale_s * pacer.scale
        pacer.observe(StepKind.MIXED, mixed)
    return mixed


def test_the_pacer_holds_mixed_steps_near_the_target_slowdown() -> None:
    for per_scale in (0.02, 0.1, 0.4):  # a fair chunk, a costly one, a very costly one
        mixed = _paced_mixed_step_seconds(2.5, 0.020, per_scale)
        assert abs(mixed - 0.050) < 0.003, per_scale
    # a chunk so cheap that even the largest allowance stays under the target
    assert _paced_mixed_step_seconds(2.5, 0.020, 0.001) < 0.050


def test_the_pacer_ignores_prefill_only_steps_and_waits_for_a_decode_step() -> None:
    pacer = StepPacer(2.5)
    pacer.observe(StepKind.MIXED, 1.0)  # no decode-only step seen yet: nothing to compare
    pacer.observe(StepKind.PREFILL, 5.0)
    assert pacer.scale == 1.0 and pacer.decode_step_s is None
    pacer.observe(StepKind.DECODE, 0.02)
    for _ in range(100):
        pacer.observe(StepKind.MIXED, 10.0)
    assert pacer.scale == MIN_SCALE
    for _ in range(100):
        pacer.observe(StepKind.MIXED, 0.001)
    assert pacer.scale == MAX_SCALE


def test_a_short_prompt_arriving_during_a_long_prefill_starts_at_the_next_step() -> None:
    """While prompts wait, prefills under way take a small share of the step: the step
    that admits the question (and ends in its first token) is short, and the question
    does not wait for the rest of the document."""
    scheduler = make_scheduler(prefill_step_s=0)
    document = make_sequence(1, list(range(100, 100 + 3000)))
    scheduler.add(document)
    assert run_plan(scheduler) == {1: 512}
    question = make_sequence(2, list(range(5000, 5016)))
    scheduler.add(question)
    assert run_plan(scheduler) == {1: 256, 2: 16}  # a short step: its first token soon
    scheduler.table.validate()
    # a long newcomer: the prompt under way keeps moving beside it
    scheduler = make_scheduler(prefill_step_s=0)
    document = make_sequence(1, list(range(100, 100 + 3000)))
    scheduler.add(document)
    run_plan(scheduler)
    scheduler.add(make_sequence(3, list(range(9000, 9000 + 2000))))
    assert run_plan(scheduler) == {1: 256, 3: 256}
    # a prompt that cannot be admitted yet (no batch slot) leaves the share to the others
    scheduler = make_scheduler(prefill_step_s=0, max_batch=1)
    scheduler.add(make_sequence(1, list(range(100, 100 + 3000))))
    run_plan(scheduler)
    scheduler.add(make_sequence(4, list(range(5000, 5016))))
    assert run_plan(scheduler) == {1: 512}
