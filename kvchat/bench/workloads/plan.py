"""Every size the workloads use: the full plan docs/benchmarks.md describes, or `--quick`'s.

`--quick` shrinks every workload (short documents, one round, few tokens, one repeat)
but keeps each one's entry, so the JSON always has the same shape. `make_plan` then
fits the sizes to the model's context and says what it cut.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BenchPlan:
    """Every size the workloads use (the full plan, or reduced for --quick)."""

    quick: bool = False
    repeats: int = 3
    prefill_lengths: tuple[int, ...] = (512, 2048)
    decode_prompt: int = 512
    decode_tokens: int = 128
    bandwidth_bytes: int = 512 << 20
    doc_tokens: int = 3000
    rounds: int = 3
    answer_tokens: int = 32
    sweep_lengths: tuple[int, ...] = (1024, 2048, 4096, 6144)
    sweep_answer_tokens: int = 8
    w2_sessions: int = 8
    w2_tokens: int = 128
    w3_ingest_tokens: int = 4000
    w3_baseline_tokens: int = 160  # each stream, alone, before and again after the ingest
    w7_doc_tokens: int = 3000  # the pasted document
    w7_pause_s: float = 8.0  # a 40-character question typed at 5 characters a second
    w7_short_pause_s: float = 2.0
    w7_answer_tokens: int = 32
    w7_window_tokens: int = 400  # streams' tokens at most while the type-ahead is computed
    w5_doc_tokens: int = 6000
    w6_sessions: int = 16
    w6_doc_tokens: int = 4000
    w6_rounds: int = 3
    w6_device_bytes: int | None = 256 << 20  # None: sized in pages (--quick's tiny documents)
    w6_host_bytes: int | None = 512 << 20
    notes: tuple[str, ...] = ()


QUICK = BenchPlan(
    quick=True,
    repeats=1,
    prefill_lengths=(128, 512),
    decode_prompt=128,
    decode_tokens=16,
    bandwidth_bytes=128 << 20,
    doc_tokens=256,
    rounds=1,
    answer_tokens=8,
    sweep_lengths=(256, 512),
    sweep_answer_tokens=2,
    w2_sessions=8,
    w2_tokens=8,
    w3_ingest_tokens=768,
    w3_baseline_tokens=16,
    w7_doc_tokens=256,
    w7_pause_s=0.5,
    w7_short_pause_s=0.1,
    w7_answer_tokens=4,
    w7_window_tokens=24,
    w5_doc_tokens=600,  # two full pages of 256 tokens: the disk tier has something to hold
    w6_sessions=6,
    w6_doc_tokens=600,
    w6_rounds=1,
    w6_device_bytes=None,
    w6_host_bytes=None,
)


def make_plan(*, quick: bool, repeats: int | None, context_length: int) -> BenchPlan:
    """The plan for this model: sizes that do not fit its context are dropped or cut, noted."""
    plan = QUICK if quick else BenchPlan()
    if repeats is not None:
        plan = replace(plan, repeats=repeats)
    room = context_length - 256  # a prompt must leave room for its answer and a follow-up
    notes: list[str] = []
    lengths = tuple(n for n in plan.prefill_lengths if n <= context_length - 1)
    sweep = tuple(n for n in plan.sweep_lengths if n <= room)
    if lengths != plan.prefill_lengths or sweep != plan.sweep_lengths:
        notes.append(f"lengths beyond the model's context ({context_length}) were dropped")
    doc = min(plan.doc_tokens, room - plan.rounds * (plan.answer_tokens + 48))
    ingest = min(plan.w3_ingest_tokens, room)
    pasted = min(plan.w7_doc_tokens, room - 64)  # the question and the template around it
    w5_doc = min(plan.w5_doc_tokens, room - 2 * (plan.answer_tokens + 48))
    w6_doc = min(plan.w6_doc_tokens, room - plan.w6_rounds * (plan.answer_tokens + 48))
    cut = (plan.w5_doc_tokens, plan.w6_doc_tokens, plan.w7_doc_tokens) != (w5_doc, w6_doc, pasted)
    if doc != plan.doc_tokens or ingest != plan.w3_ingest_tokens or cut:
        notes.append(f"documents were cut to fit the model's context ({context_length})")
    return replace(
        plan,
        prefill_lengths=lengths or (min(128, context_length - 1),),
        decode_prompt=min(plan.decode_prompt, room),
        sweep_lengths=sweep or (max(64, room // 2),),
        doc_tokens=max(32, doc),
        w3_ingest_tokens=max(32, ingest),
        w7_doc_tokens=max(32, pasted),
        w5_doc_tokens=max(32, w5_doc),
        w6_doc_tokens=max(32, w6_doc),
        notes=tuple(notes),
    )
