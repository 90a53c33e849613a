"""Ministral 3 against transformers: YaRN rotary (an original context of 64 stretched
sixteen times in the tiny model) and queries scaled up by position past each original
context (`query_scaling_beta`), so the prompts here run past several of them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.engine_helpers import generate
from tests.parity_helpers import hf_logits, hf_model, kvchat_logits, random_ids, rel_err
from tests.tiny_models import MINISTRAL3_ORIGINAL_CONTEXT, write_tiny_model


@pytest.fixture(scope="module")
def ministral_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ministral3"), "ministral3")


def test_config_reads_yarn_and_the_query_scaling(ministral_folder):
    config = ModelConfig.from_file(ministral_folder / "config.json")
    scaling = config.rope_scaling
    assert scaling is not None and scaling.kind == "yarn"
    assert (scaling.factor, scaling.original_max_position_embeddings) == (16.0, 64)
    assert (scaling.attention_factor, config.query_scaling_beta) == (1.0, 0.1)


@pytest.mark.parametrize("paged", [False, True])
def test_logits_match_transformers_fp32_past_the_original_context(ministral_folder, paged):
    model = load_model(str(ministral_folder), dtype="float32", device="cpu")
    ids = random_ids(3 * MINISTRAL3_ORIGINAL_CONTEXT + 10, seed=1)
    ours = kvchat_logits(model, ids.tolist(), paged=paged)
    assert rel_err(ours, hf_logits(ministral_folder, ids)) < 1e-4


@pytest.mark.parametrize(
    "change",
    [{"query_scaling_beta": None}, {"rope_scaling": None}],
    ids=["queries unscaled", "rotary without YaRN"],
)
def test_leaving_either_out_gives_other_logits(ministral_folder, change):
    """The check above can fail: without the query scaling or YaRN's frequencies the
    logits are far off."""
    from kvchat.model.rope import RotaryTable

    model = load_model(str(ministral_folder), dtype="float32", device="cpu")
    t = model.transformer
    t.config = replace(t.config, **change)
    t.rotary = RotaryTable(t.config, t.max_positions, t.dtype, t.device)
    ids = random_ids(3 * MINISTRAL3_ORIGINAL_CONTEXT + 10, seed=1)
    ours = kvchat_logits(model, ids.tolist(), paged=True)
    assert rel_err(ours, hf_logits(ministral_folder, ids)) > 0.01


def test_bf16_error_within_transformers_own(ministral_folder):
    ids = random_ids(160, seed=2)
    exact = hf_logits(ministral_folder, ids)
    theirs = rel_err(hf_logits(ministral_folder, ids, torch.bfloat16), exact)
    model = load_model(str(ministral_folder), dtype="bfloat16", device="cpu")
    ours = rel_err(kvchat_logits(model, ids.tolist(), paged=True), exact)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_greedy_text_through_the_engine_equals_transformers(ministral_folder):
    ids = random_ids(120, seed=3).tolist()
    with torch.no_grad():
        theirs = (
            hf_model(ministral_folder)
            .generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)[
                0, len(ids) :
            ]
            .tolist()
        )
    model = load_model(str(ministral_folder), dtype="float32", device="cpu")
    assert generate(model, ids, max_tokens=24, ignore_eos=True) == theirs


def test_the_vision_language_checkpoint_runs_its_text_model(ministral_folder, tmp_path):
    """Ministral 3 ships as Mistral3ForConditionalGeneration: kvchat reads its text model
    (config and weights, never the vision tower's) and computes what transformers does
    for text."""
    from transformers import (
        AutoModelForCausalLM,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralVisionConfig,
    )

    text = AutoModelForCausalLM.from_pretrained(ministral_folder, dtype=torch.float32)
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        head_dim=16, image_size=28, patch_size=14,
    )  # fmt: skip
    wrapped = Mistral3ForConditionalGeneration(
        Mistral3Config(text_config=text.config, vision_config=vision, tie_word_embeddings=False)
    )
    wrapped.model.language_model.load_state_dict(text.model.state_dict())
    wrapped.lm_head.load_state_dict(text.lm_head.state_dict())
    folder = tmp_path / "ministral3-vl"
    wrapped.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ministral_folder / name).read_bytes())
    model = load_model(str(folder), dtype="float32", device="cpu")
    assert model.config.model_type == "ministral3" and model.config.query_scaling_beta == 0.1
    ids = random_ids(150, seed=7)
    reference = Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=ids[None]).logits[0].float()
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-4
