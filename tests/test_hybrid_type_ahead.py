"""A hybrid model's type-ahead makes progress: its chunks end at page ends, where the next
resumes from the state kept there, even when the states after the first page were let go
and when the step budget is shorter than a page."""

from __future__ import annotations

import pytest

from kvchat.model.loader import load_model
from tests.engine_helpers import Progress, small_engine
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("q35"), "qwen3_5_text")
    return load_model(str(folder), dtype="float32", device="cpu")


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 17 + 5 * i) % 200 + 3 for i in range(n)]


def test_a_type_ahead_whose_states_were_let_go_still_makes_progress(model):
    draft = prompt(8, 96)
    with small_engine(model, step_token_budget=16) as engine:  # pages of 16 tokens
        first = Progress()
        engine.type_ahead(draft, first)
        first.wait_done()
        with engine._lock:  # the LRU let go of every state but the first page's
            table = engine.table
            for i in range(table.num_pages):
                if table.states.has(i) and table.page_info(i).parent != table.salt:
                    table.states.drop(i)
        more = Progress()
        engine.type_ahead([*draft, *prompt(9, 24)], more)
        assert more.wait_done(timeout=60).ready_tokens == len(draft) + 24


def test_a_type_ahead_whose_chunks_are_shorter_than_a_page_makes_progress(model):
    draft = prompt(8, 40)
    with small_engine(model, step_token_budget=8, max_batch=4) as engine:  # pages of 16
        progress = Progress()
        engine.type_ahead(draft, progress)
        assert progress.wait_done(timeout=60).ready_tokens == len(draft)
