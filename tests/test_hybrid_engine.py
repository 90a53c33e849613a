"""Hybrid models (Qwen3.5, dense and MoE, and Qwen3-Next) through the engine: each
sequence's linear-layer state carried from step to step, sequences side by side, and a
follow-up resumed from the state kept where the last full page of its history ends, with
transformers' greedy text as the oracle."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, Progress, generate, small_engine
from tests.parity_helpers import hf_logits, hf_model, rel_err
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def family(request, tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    return folder, load_model(str(folder), dtype="float32", device="cpu")


def theirs(folder, ids: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model(folder).generate(
            torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(ids) :].tolist()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 17 + 5 * i) % 200 + 3 for i in range(n)]


@pytest.mark.parametrize("attention", ["native", "sdpa"])
def test_greedy_text_in_prefill_chunks_and_steps_equals_transformers(family, attention):
    folder, model = family
    ids = prompt(1, 90)
    ours = generate(
        model, ids, max_tokens=20, ignore_eos=True, attention=attention, step_token_budget=8,
        max_batch=4,
    )  # fmt: skip
    assert ours == theirs(folder, ids, 20)


def test_sequences_side_by_side_each_continue_their_own_state(family):
    folder, model = family
    prompts = [prompt(seed, n) for seed, n in ((2, 12), (3, 47), (4, 80))]
    with small_engine(model, step_token_budget=32, max_batch=4) as engine:
        collectors = [Collector() for _ in prompts]
        for ids, c in zip(prompts, collectors, strict=True):
            engine.submit(GenerationRequest(tuple(ids), SamplingParams(), 12, ignore_eos=True), c)
        together = [list(c.wait().generated_ids) for c in collectors]
        assert engine.sequence_states is not None and len(engine.sequence_states) == 0
    assert together == [theirs(folder, ids, 12) for ids in prompts]


def test_a_follow_up_resumes_from_the_state_at_its_last_full_page(family):
    folder, model = family
    first = prompt(5, 40)
    with small_engine(model) as engine:  # pages of 16 tokens
        c = Collector()
        engine.submit(GenerationRequest(tuple(first), max_tokens=6, ignore_eos=True), c)
        answer = list(c.wait().generated_ids)
        follow_up = [*first, *answer, 9, 10, 11]  # 49 tokens; 45 computed, 2 full pages
        r = engine.residency(follow_up)
        assert (r.device, r.nowhere) == (32, 17)
        c = Collector()
        engine.submit(GenerationRequest(tuple(follow_up), max_tokens=6, ignore_eos=True), c)
        done = c.wait()
        assert done.error is None and done.cached_tokens.device == 32
        assert list(done.generated_ids) == theirs(folder, follow_up, 6)
        stats = engine.stats()
        assert stats.window is None and stats.states_kept > 0 and stats.state_bytes > 0
        engine.validate_cache()


def test_a_state_let_go_resumes_from_an_earlier_one(family):
    folder, model = family
    first = prompt(6, 70)
    with small_engine(model) as engine:
        c = Collector()
        engine.submit(GenerationRequest(tuple(first), max_tokens=4, ignore_eos=True), c)
        answer = list(c.wait().generated_ids)
        engine.table.states.capacity = 2  # the first conversation's page ends 16 and 32 go
        c = Collector()
        engine.submit(GenerationRequest(tuple(prompt(7, 40)), max_tokens=2), c)
        c.wait()
        follow_up = [*first, *answer, 9]
        c = Collector()
        engine.submit(GenerationRequest(tuple(follow_up), max_tokens=6, ignore_eos=True), c)
        done = c.wait()
        assert done.cached_tokens.device in (0, 48, 64)  # wherever a state was left
        assert list(done.generated_ids) == theirs(folder, follow_up, 6)


def test_a_type_ahead_is_kept_at_page_ends_and_its_turn_resumes_there(family):
    folder, model = family
    draft = prompt(8, 100)
    with small_engine(model) as engine:  # pages of 16 tokens
        progress = Progress()
        engine.type_ahead(draft, progress)
        assert progress.wait_done().ready_tokens == len(draft)
        c = Collector()
        engine.submit(GenerationRequest((*draft, 4, 5), max_tokens=6, ignore_eos=True), c)
        done = c.wait()
        assert done.cached_tokens.device == 96 and done.draft_tokens == 96
        assert list(done.generated_ids) == theirs(folder, [*draft, 4, 5], 6)


def test_a_fork_resumes_from_the_last_state_kept_before_it(family):
    """Edit-and-resend or a fork cuts a history: its prefix resumes from the last page end
    at or before the cut whose state is kept (every page end is, until let go)."""
    folder, model = family
    history = prompt(9, 70)
    with small_engine(model) as engine:
        c = Collector()
        engine.submit(GenerationRequest(tuple(history), max_tokens=4, ignore_eos=True), c)
        c.wait()
        fork = [*history[:53], 1, 2]
        c = Collector()
        engine.submit(GenerationRequest(tuple(fork), max_tokens=6, ignore_eos=True), c)
        done = c.wait()
        assert done.cached_tokens.device == 48
        assert list(done.generated_ids) == theirs(folder, fork, 6)


def test_a_conversation_resumes_from_the_host_tier_with_its_state(family):
    """Another conversation takes the device pages: the first one's pages go to the host
    tier with the state at its last full page, and a switch back resumes there."""
    folder, model = family
    c = model.config
    page_bytes = c.kv_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 4
    a = prompt(10, 60)
    with small_engine(
        model, device_cache_bytes=12 * page_bytes, host_cache_bytes=1 << 20
    ) as engine:
        done = Collector()
        engine.submit(GenerationRequest(tuple(a), max_tokens=5, ignore_eos=True), done)
        answer = list(done.wait().generated_ids)
        other = Collector()
        engine.submit(GenerationRequest(tuple(prompt(11, 100)), max_tokens=2), other)
        other.wait()
        follow_up = [*a, *answer, 7]  # 64 tokens computed: 4 full pages
        assert engine.residency(follow_up).host > 0
        back = Collector()
        engine.submit(GenerationRequest(tuple(follow_up), max_tokens=6, ignore_eos=True), back)
        result = back.wait()
        assert result.cached_tokens.host > 0 and result.cached_tokens.total == 64
        assert list(result.generated_ids) == theirs(folder, follow_up, 6)
        engine.validate_cache()


def test_after_a_restart_a_conversation_resumes_from_the_disk_tier_with_its_state(family, tmp_path):
    folder, model = family
    disk = dict(disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv", host_cache_bytes=0)
    a = prompt(12, 60)
    with small_engine(model, **disk) as engine:
        done = Collector()
        engine.submit(GenerationRequest(tuple(a), max_tokens=5, ignore_eos=True), done)
        answer = list(done.wait().generated_ids)
    follow_up = [*a, *answer, 7]  # 64 tokens computed: 4 full pages, a state at the 4th
    with small_engine(model, **disk) as restarted:
        assert restarted.residency(follow_up).disk == 64
        back = Collector()
        restarted.submit(GenerationRequest(tuple(follow_up), max_tokens=6, ignore_eos=True), back)
        result = back.wait()
        assert result.cached_tokens.disk == 64
        assert list(result.generated_ids) == theirs(folder, follow_up, 6)
        assert restarted.stats().states_kept > 0


class LogitsRecorder:
    """An engine's transformer, keeping the logits each forward gives the sampler."""

    def __init__(self, transformer) -> None:
        self._inner = transformer
        self.logits: list[torch.Tensor] = []

    def forward(self, *args):
        out = self._inner.forward(*args)
        self.logits.append(out.detach().float().clone())
        return out

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def first_token_logits(engine, ids: list[int]) -> tuple[torch.Tensor, object]:
    """The logits the engine samples `ids`' first generated token from, and the result."""
    recorder = engine.transformer
    recorder.logits.clear()
    done = Collector()
    engine.submit(GenerationRequest(tuple(ids), max_tokens=1, ignore_eos=True), done)
    result = done.wait()
    return recorder.logits[-1][-1], result


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_bf16_logits_after_a_switch_back_are_within_transformers_own_error(family, tier, tmp_path):
    """In bf16, the follow-up resumed from the state the host tier kept (or a disk page
    read after a restart) is as close to float32 transformers as transformers' own bf16."""
    folder, _ = family
    model = load_model(str(folder), dtype="bfloat16", device="cpu")
    c = model.config
    page_bytes = c.kv_layers * 2 * 16 * c.num_kv_heads * c.head_dim * 2
    if tier == "host":
        config = dict(device_cache_bytes=12 * page_bytes, host_cache_bytes=1 << 20)
    else:
        config = dict(disk_cache_bytes=64 << 20, disk_cache_dir=tmp_path / "kv", host_cache_bytes=0)
    a = prompt(13, 60)
    with small_engine(model, **config) as engine:
        done = Collector()
        engine.submit(GenerationRequest(tuple(a), max_tokens=5, ignore_eos=True), done)
        follow_up = [*a, *done.wait().generated_ids, 7]  # 66 tokens: 4 full pages
        if tier == "host":  # another conversation takes the device pages
            other = Collector()
            engine.submit(GenerationRequest(tuple(prompt(14, 100)), max_tokens=2), other)
            other.wait()
            engine.transformer = LogitsRecorder(engine.transformer)
            ours, result = first_token_logits(engine, follow_up)
            assert result.cached_tokens.host > 0
    if tier == "disk":
        with small_engine(model, **config) as restarted:
            restarted.transformer = LogitsRecorder(restarted.transformer)
            ours, result = first_token_logits(restarted, follow_up)
            assert result.cached_tokens.disk == 64
    assert result.cached_tokens.total == 64  # resumed at the 4th page: 2 of 66 computed
    ids = torch.tensor(follow_up)
    exact = hf_logits(folder, ids)[-1]
    theirs = rel_err(hf_logits(folder, ids, torch.bfloat16)[-1], exact)
    assert rel_err(ours, exact) <= 1.5 * theirs + 1e-3, (rel_err(ours, exact), theirs)


def test_the_host_tiers_budget_holds_the_states_it_keeps(family):
    """The host tier keeps states of its pages in host memory, sized from its own budget
    as the device's are from its (a share, half at most): its pages are what is left."""
    from kvchat.engine.tiers.kv_store import pages_for_bytes

    _, model = family
    c, host_bytes = model.config, 4 << 20
    with small_engine(model, host_cache_bytes=host_bytes) as engine:
        states = engine.table.states
        assert states is not None
        kept = engine.table._tiers.states_capacity * states.state_bytes
        assert 0 < kept <= host_bytes // 2
        geometry = (c.kv_layers, 16, c.num_kv_heads, c.head_dim, torch.float32, "native")
        assert engine.host_store is not None
        assert engine.host_store.num_slots == pages_for_bytes(host_bytes - kept, *geometry)
