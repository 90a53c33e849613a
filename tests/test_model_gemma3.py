"""Gemma 3 against transformers: five windowed layers to one global, each kind with its
rotary base, (1 + w) norms before and after attention and the feed-forward, q/k norms,
scaled embeddings and queries, GELU.

The tiny model's window is 16 tokens (`GEMMA3_WINDOW`), so every prompt here outgrows it:
a windowed layer that attended to the whole context would be far off (checked).
"""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.request import GenerationRequest, SamplingParams
from kvchat.errors import ModelLoadError
from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, generate, small_engine
from tests.parity_helpers import hf_logits, hf_model, kvchat_logits, random_ids, rel_err
from tests.tiny_models import GEMMA3_WINDOW, write_tiny_model


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


def test_config_reads_the_layer_pattern_and_both_rotary_bases(gemma_folder):
    config = ModelConfig.from_file(gemma_folder / "config.json")
    assert config.layer_windows == (GEMMA3_WINDOW,) * 5 + (None,)
    assert (config.rope_theta, config.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert config.gemma and config.qk_norm and config.tie_word_embeddings
    assert config.sliding_window is None  # the context is not capped at the window


@pytest.mark.parametrize("paged", [False, True])
def test_logits_match_transformers_fp32_beyond_the_window(gemma_folder, paged):
    model = load_model(str(gemma_folder), dtype="float32", device="cpu")
    ids = random_ids(5 * GEMMA3_WINDOW, seed=1, low=3)
    assert (
        rel_err(kvchat_logits(model, ids.tolist(), paged=paged), hf_logits(gemma_folder, ids))
        < 1e-4
    )


def test_attending_past_the_window_gives_other_logits(gemma_folder):
    """The check above can fail: the same model with its windows taken away is far off."""
    from dataclasses import replace

    model = load_model(str(gemma_folder), dtype="float32", device="cpu")
    for layer in model.transformer.layers:
        layer.window = None
    model.transformer.config = replace(model.config, layer_windows=None)
    ids = random_ids(5 * GEMMA3_WINDOW, seed=1, low=3)
    assert (
        rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(gemma_folder, ids)) > 0.01
    )


def test_a_query_scale_other_than_head_dim(tmp_path):
    """Gemma 3 27B scales queries by hidden / heads, not head_dim: kvchat follows the config."""
    folder = write_tiny_model(tmp_path, "gemma3_text", query_pre_attn_scalar=20)
    model = load_model(str(folder), dtype="float32", device="cpu")
    ids = random_ids(40, seed=3, low=3)
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids)) < 1e-4


def test_bf16_error_within_transformers_own(gemma_folder):
    ids = random_ids(64, seed=2, low=3)
    exact = hf_logits(gemma_folder, ids)
    theirs = rel_err(hf_logits(gemma_folder, ids, torch.bfloat16), exact)
    model = load_model(str(gemma_folder), dtype="bfloat16", device="cpu")
    ours = rel_err(kvchat_logits(model, ids.tolist(), paged=True), exact)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


@pytest.mark.parametrize("attention", ["native", "sdpa", "flex"])
def test_greedy_text_through_the_engine_equals_transformers(gemma_folder, attention):
    """A prompt three windows long, then 24 tokens decoded in 8-token prefill chunks and
    steps: every path of the engine attends within the window as transformers does."""
    ids = random_ids(3 * GEMMA3_WINDOW, seed=5, low=3).tolist()
    with torch.no_grad():
        theirs = (
            hf_model(gemma_folder)
            .generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)[
                0, len(ids) :
            ]
            .tolist()
        )
    model = load_model(str(gemma_folder), dtype="float32", device="cpu")
    ours = generate(
        model, ids, max_tokens=24, ignore_eos=True, attention=attention, step_token_budget=8,
        max_batch=4,
    )  # fmt: skip
    assert ours == theirs


def test_a_batch_of_sequences_equals_each_alone(gemma_folder):
    """Sequences inside and beyond the window in one step: each reads its own window."""
    model = load_model(str(gemma_folder), dtype="float32", device="cpu")
    prompts = [random_ids(n, seed=n, low=3).tolist() for n in (12, 40, 70)]
    alone = [generate(model, p, max_tokens=10, ignore_eos=True) for p in prompts]
    with small_engine(model) as engine:
        collectors = [Collector() for _ in prompts]
        for ids, collector in zip(prompts, collectors, strict=True):
            engine.submit(
                GenerationRequest(tuple(ids), SamplingParams(), 10, ignore_eos=True), collector
            )
        together = [list(c.wait().generated_ids) for c in collectors]
    assert together == alone


def test_attention_soft_capping_is_refused(tmp_path):
    import json

    folder = write_tiny_model(tmp_path, "gemma3_text", with_tokenizer=False)
    raw = json.loads((folder / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        ModelConfig.from_dict({**raw, "attn_logit_softcapping": 50.0})


def write_vision_language_gemma(folder, text_folder):
    """Gemma 3 4B's layout, scaled down: the tiny text model's weights inside
    Gemma3ForConditionalGeneration beside a small vision tower, saved as the hub's
    checkpoints are (`language_model.model.*`, `vision_tower.*`), its text_config
    leaving Gemma3TextConfig's defaults out as theirs do."""
    import json

    from transformers import (
        AutoModelForCausalLM,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text.config, vision_config=vision, mm_tokens_per_image=4)
    )
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((text_folder / name).read_bytes())
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    defaults = {"rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "rope_parameters": None}
    raw["text_config"] = {
        k: v for k, v in raw["text_config"].items() if k not in defaults or v != defaults[k]
    }
    config_file.write_text(json.dumps(raw))
    return folder


def test_a_vision_language_gemma_runs_its_text_model(gemma_folder, tmp_path):
    """Gemma 3 4B and up ship as a vision-language model: kvchat reads the text model's
    config and weights from it (never the vision tower's) and computes what transformers'
    Gemma3ForConditionalGeneration computes for text."""
    from transformers import Gemma3ForConditionalGeneration

    folder = write_vision_language_gemma(tmp_path / "gemma3-vl", gemma_folder)
    model = load_model(str(folder), dtype="float32", device="cpu")
    assert model.config.layer_windows == (GEMMA3_WINDOW,) * 5 + (None,)
    ids = random_ids(48, seed=7, low=3)
    reference = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(input_ids=ids[None]).logits[0].float()
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-4
