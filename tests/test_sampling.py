"""Sampling: greedy is argmax; top-p keeps exactly the nucleus a full sort would (without
sorting the vocabulary); draws follow the kept probabilities; a seed fixes the draws."""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.request import SamplingParams
from kvchat.engine.sampling import draw, nucleus, sample_next


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The reference: sort everything, keep the smallest prefix whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return {int(i) for i, b in zip(order, before, strict=True) if b <= top_p}


@pytest.mark.parametrize("sharpness", [0.3, 1.0, 4.0])  # flat (a nucleus of thousands) to peaked
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_nucleus_is_the_sorted_prefix(sharpness, top_p):
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * sharpness
    probs = torch.softmax(logits, dim=-1)
    kept, ids = nucleus(probs, top_p)
    chosen = {int(i) for i, p in zip(ids, kept, strict=True) if p > 0}
    assert chosen == _sorted_nucleus(probs, top_p)
    assert bool((kept[:-1] >= kept[1:]).all())  # most likely first


def test_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert sample_next(logits, SamplingParams(temperature=0.0), None) == int(logits.argmax())


def test_top_p_draws_stay_in_the_nucleus_and_follow_its_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()
    params = SamplingParams(temperature=1.0, top_p=0.75)  # nucleus {0, 1}: 0.5 + 0.3
    g = torch.Generator().manual_seed(0)
    draws = [sample_next(logits, params, g) for _ in range(4000)]
    assert set(draws) == {0, 1}
    share = draws.count(0) / len(draws)
    assert abs(share - 0.5 / 0.8) < 0.03


def test_draw_follows_the_weights_and_never_picks_a_zero():
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(6)
    for _ in range(8000):
        counts[draw(weights, g)] += 1
    assert counts[0] == counts[2] == counts[5] == 0
    torch.testing.assert_close(counts / counts.sum(), weights / weights.sum(), atol=0.02, rtol=0)


def test_draw_never_picks_a_trailing_zero_when_the_uniform_rounds_onto_the_total(monkeypatch):
    """u = rand * total can round up onto the total: the draw is then the last nonzero
    weight, not the last index."""
    monkeypatch.setattr(torch, "rand", lambda *a, dtype=None, **k: torch.ones(1, dtype=dtype))
    assert draw(torch.tensor([0.0, 2.0, 1.0, 0.0, 0.0]), None) == 2


def test_a_seed_fixes_the_draws():
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.7, top_p=0.9)

    def run() -> list[int]:
        g = torch.Generator().manual_seed(42)
        return [sample_next(logits, params, g) for _ in range(20)]

    assert run() == run()
