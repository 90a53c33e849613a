"""Phi-3 / Phi-4-mini against transformers: q/k/v and gate/up fused in the files, 3/4 of
each head rotating, LongRoPE with a short and a long set of frequencies.

transformers picks LongRoPE's set by the length it runs; kvchat picks it by the context
it runs (as llama.cpp does), so each check runs kvchat in the context whose set
transformers uses for that length: up to the original context (256 for the tiny model)
the short set, beyond it the long one.
"""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.model.loader import load_model
from tests.engine_helpers import generate
from tests.parity_helpers import hf_logits, hf_model, kvchat_logits, random_ids, rel_err
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT, write_tiny_model

LONG_CONTEXT = 2048  # the tiny model's whole context: the long set


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3")


@pytest.mark.parametrize(
    ("length", "context"),
    [(96, PHI3_ORIGINAL_CONTEXT), (400, LONG_CONTEXT)],
    ids=["short set", "long set"],
)
@pytest.mark.parametrize("paged", [False, True])
def test_logits_match_transformers_fp32_in_both_longrope_ranges(
    phi3_folder, length, context, paged
):
    model = load_model(str(phi3_folder), dtype="float32", device="cpu")
    assert model.config.rotary_dim == 12 and model.config.head_dim == 16
    model.transformer.fit_context(context)
    ids = random_ids(length, seed=1)
    reference = hf_logits(phi3_folder, ids)
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=paged), reference) < 1e-4


def test_the_other_frequency_set_gives_other_logits(phi3_folder):
    """The check above can fail: the long set where transformers uses the short one is
    far off (so is leaving the attention factor out)."""
    model = load_model(str(phi3_folder), dtype="float32", device="cpu")
    model.transformer.fit_context(LONG_CONTEXT)
    ids = random_ids(96, seed=1)
    assert (
        rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(phi3_folder, ids)) > 0.01
    )


def test_bf16_error_within_transformers_own(phi3_folder):
    ids = random_ids(96, seed=2)
    exact = hf_logits(phi3_folder, ids)
    theirs = rel_err(hf_logits(phi3_folder, ids, torch.bfloat16), exact)
    model = load_model(str(phi3_folder), dtype="bfloat16", device="cpu")
    model.transformer.fit_context(PHI3_ORIGINAL_CONTEXT)
    ours = rel_err(kvchat_logits(model, ids.tolist(), paged=True), exact)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize(
    ("length", "context"),
    [(40, PHI3_ORIGINAL_CONTEXT), (300, LONG_CONTEXT)],
    ids=["short set", "long set"],
)
def test_greedy_text_through_the_engine_equals_transformers_fp32(phi3_folder, length, context):
    """The engine fits the model's rotary to its context (`--context-size`)."""
    model = load_model(str(phi3_folder), dtype="float32", device="cpu")
    ids = random_ids(length, seed=3).tolist()
    with torch.no_grad():
        out = hf_model(phi3_folder).generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
    reference = out[0, len(ids) :].tolist()
    got = generate(model, ids, max_tokens=24, ignore_eos=True, context_tokens=context)
    assert got == reference


def test_keys_of_the_two_sets_never_share_pages(phi3_folder):
    """A page written under one set is another page under the other: the cache's salt
    names the set (the disk tier outlives a change of --context-size)."""
    model = load_model(str(phi3_folder), dtype="float32", device="cpu")
    salts = set()
    for context in (PHI3_ORIGINAL_CONTEXT, LONG_CONTEXT, PHI3_ORIGINAL_CONTEXT // 2):
        engine = Engine(
            model,
            EngineConfig(device_cache_bytes=8 << 20, host_cache_bytes=0, context_tokens=context),
            start=False,
        )
        salts.add(engine.table.salt)
        engine.close()
    assert len(salts) == 2  # both short-set contexts share one
