"""Qwen3.5 (dense, text) against transformers: linear-attention layers (Gated DeltaNet)
beside gated full attention with partial rotary, (1 + w) norms, SwiGLU; Qwen3-Next, the
same layers with routed experts and a gated shared expert; and Qwen3.5-MoE, Qwen3.5's
layers with those experts in every layer, stacked in its files.

The tiny model alternates the two kinds (`QWEN35_LAYERS`), so a K/V store holds two of
its four layers and the linear layers' states, carried from one forward to the next
(`FreshStates`), are all the memory the other two have: a decode step that loses them
is far off (checked).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.errors import ModelLoadError
from kvchat.model.batch import ForwardBatch, FreshStates
from kvchat.model.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from kvchat.model.loader import load_model
from kvchat.model.safetensors_folder import read_tensors
from tests.parity_helpers import hf_logits, kvchat_logits, random_ids, rel_err
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def qwen35_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen35"), "qwen3_5_text")


def load(folder, dtype: str = "float32"):
    return load_model(str(folder), dtype=dtype, device="cpu")


def test_config_reads_the_layer_kinds_and_sizes_the_stores_by_them(qwen35_folder):
    config = ModelConfig.from_file(qwen35_folder / "config.json")
    assert config.layer_kinds == (LINEAR_ATTENTION, FULL_ATTENTION) * 2
    assert config.hybrid and config.unit_offset_norms and config.qk_norm
    assert (config.attention_layers, config.linear_layers, config.kv_layers) == ((1, 3), (0, 2), 2)
    assert config.rotary_dim == 8  # a quarter of 32
    assert config.delta_net is not None and config.delta_net.conv_dim == 2 * 32 + 64
    assert not config.tie_word_embeddings


def test_layer_kinds_from_the_full_attention_interval_without_layer_types(qwen35_folder):
    raw = json.loads((qwen35_folder / "config.json").read_text())
    del raw["layer_types"]
    raw.update(num_hidden_layers=8)
    config = ModelConfig.from_dict(raw)  # transformers' default: 4
    assert config.attention_layers == (3, 7) and config.kv_layers == 2
    config = ModelConfig.from_dict({**raw, "full_attention_interval": 2})
    assert config.attention_layers == (1, 3, 5, 7)


def test_the_families_that_attend_in_every_layer_keep_kv_in_every_layer():
    config = ModelConfig.from_dict(
        {
            "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        }
    )  # fmt: skip
    assert not config.hybrid and not config.unit_offset_norms
    assert (config.kv_layers, config.attention_layers, config.linear_layers) == (3, (0, 1, 2), ())


@pytest.mark.parametrize("paged", [False, True])
def test_logits_match_transformers_fp32(qwen35_folder, paged):
    """Whole prompt with no cache; or a prefill chunk through a K/V store of the two
    attention layers, then a decode step a token, the states carried across forwards."""
    model = load(qwen35_folder)
    ids = random_ids(40, seed=1, low=3)
    ours = kvchat_logits(model, ids.tolist(), paged=paged)
    assert rel_err(ours, hf_logits(qwen35_folder, ids)) < 1e-4


def test_a_prompt_longer_than_a_chunk_of_the_rule(qwen35_folder):
    """Over 64 tokens the linear layers' prefill runs the delta rule in two chunks."""
    model = load(qwen35_folder)
    ids = random_ids(100, seed=4, low=3)
    ours = kvchat_logits(model, ids.tolist(), paged=True)
    assert rel_err(ours, hf_logits(qwen35_folder, ids)) < 1e-4


def test_decoding_without_the_carried_states_gives_other_logits(qwen35_folder):
    """The check above can fail: decode steps that start their linear layers from zeros
    (a fresh state each forward) are far off."""
    model = load(qwen35_folder)
    ids = random_ids(40, seed=1, low=3).tolist()
    forgetful = paged_logits(model, [ids], [30], carry_states=False)[0]
    assert rel_err(forgetful, hf_logits(qwen35_folder, torch.tensor(ids))) > 0.01


def test_bf16_error_within_transformers_own(qwen35_folder):
    ours, theirs = bf16_errors(qwen35_folder)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def bf16_errors(folder) -> tuple[float, float]:
    """kvchat's bf16 error (a prefill then decode steps) and transformers' own bf16 error,
    both against transformers in float32, over 64 seeded ids."""
    ids = random_ids(64, seed=2, low=3)
    exact = hf_logits(folder, ids)
    theirs = rel_err(hf_logits(folder, ids, torch.bfloat16), exact)
    ours = rel_err(kvchat_logits(load(folder, "bfloat16"), ids.tolist(), paged=True), exact)
    return ours, theirs


def paged_logits(
    model, prompts: list[list[int]], prefill: list[int], *, carry_states: bool = True
) -> list[torch.Tensor]:
    """Each sequence's logits at all its positions, run together: the first forward
    prefills `prefill[i]` tokens of each, then one forward a step decodes a token of every
    sequence not yet at its end (the states of each run carried, or not, across
    forwards). Runs keep their place in every batch, as `FreshStates` tells them apart by
    index: sequences that end early are given a token past their end and its logits
    dropped."""
    t, c, page_size = model.transformer, model.config, 16
    longest = max(len(p) for p in prompts)
    last = max(prefill) + longest - min(prefill)  # the furthest position written
    pages_each = (last + page_size) // page_size + 1
    shape = (c.kv_layers, pages_each * len(prompts), page_size, c.num_kv_heads, c.head_dim)
    attention = PagedAttention(torch.zeros(shape, dtype=t.dtype), torch.zeros(shape, dtype=t.dtype))
    page_lists = [
        list(range(i * pages_each, (i + 1) * pages_each))[::-1] for i in range(len(prompts))
    ]
    states = FreshStates()
    batch = ForwardBatch.from_runs(
        [p[:n] for p, n in zip(prompts, prefill, strict=True)], [0] * len(prompts), all_logits=True
    )
    attention.prepare(batch, page_lists)
    first = t.forward(batch, attention, states if carry_states else None)
    outs = [list(first.split(list(prefill)))]
    for step in range(longest - min(prefill)):
        positions = [n + step for n in prefill]
        runs = [[p[min(pos, len(p) - 1)]] for p, pos in zip(prompts, positions, strict=True)]
        batch = ForwardBatch.from_runs(runs, positions)
        attention.prepare(batch, page_lists)
        logits = t.forward(batch, attention, states if carry_states else None)
        outs.append([logits[i : i + 1] for i in range(len(prompts))])
    return [torch.cat([step[i] for step in outs])[: len(p)] for i, p in enumerate(prompts)]


def test_a_batch_of_sequences_equals_each_alone(qwen35_folder):
    """Two sequences of different lengths prefilled in one forward, then decoded together:
    each run's linear layers read and write its own state."""
    for ids, ours, alone in batched_and_alone(qwen35_folder):
        assert ours.shape == (len(ids), 512)
        assert rel_err(ours, alone) < 1e-5
        assert rel_err(ours, hf_logits(qwen35_folder, torch.tensor(ids))) < 1e-4


def batched_and_alone(folder) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Two prompts (36 and 21 tokens) prefilled in one forward (30 and 12 tokens), then
    decoded together; for each, (ids, its logits in the batch, its logits alone)."""
    model = load(folder)
    prompts = [random_ids(n, seed=n, low=3).tolist() for n in (36, 21)]
    prefill = [30, 12]
    together = paged_logits(model, prompts, prefill)
    return [
        (ids, ours, paged_logits(model, [ids], [n])[0])
        for ids, n, ours in zip(prompts, prefill, together, strict=True)
    ]


def write_vision_language_qwen35(folder, text_folder, *, moe: bool = False):
    """Qwen3.5's hub layout, scaled down: the tiny text model's weights inside
    Qwen3_5ForConditionalGeneration (Qwen3_5MoeForConditionalGeneration: `moe`, its
    experts stacked as the hub's files hold them) beside a small vision tower
    (`model.language_model.*`, `model.visual.*`, the text config under `text_config`), and
    a multi-token-prediction head (`mtp.*`) as the hub's checkpoints carry, which neither
    transformers nor kvchat reads."""
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoModelForCausalLM,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeVisionConfig,
        Qwen3_5VisionConfig,
    )

    text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
    vision_config, config, model_class = (
        (Qwen3_5MoeVisionConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        if moe
        else (Qwen3_5VisionConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    vision = vision_config(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        num_position_embeddings=16, patch_size=14,
    )  # fmt: skip
    model = model_class(config(text_config=text.config.to_dict(), vision_config=vision.to_dict()))
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(folder, safe_serialization=True, save_original_format=not moe)
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    tensors["mtp.fc.weight"] = torch.randn(3, 5)  # a shape no layer of the model has
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((text_folder / name).read_bytes())
    return folder


def test_a_vision_language_qwen35_runs_its_text_model(qwen35_folder, tmp_path):
    """Qwen3.5 ships as a vision-language model: kvchat reads the text model's config and
    weights from it (never the vision tower's nor the mtp head's) and computes what
    transformers' Qwen3_5ForConditionalGeneration computes for text."""
    from transformers import Qwen3_5ForConditionalGeneration

    folder = write_vision_language_qwen35(tmp_path / "qwen35-vl", qwen35_folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    names = {name for name, _ in read_tensors(folder, torch.float32, torch.device("cpu"))}
    assert "model.embed_tokens.weight" in names
    assert not any(
        name.startswith(("mtp.", "model.visual.", "model.language_model.")) for name in names
    )
    model = load(folder)
    assert model.config.model_type == "qwen3_5_text" and model.config.kv_layers == 2
    ids = random_ids(40, seed=7, low=3)
    reference = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(input_ids=ids[None]).logits[0].float()
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-4


@pytest.fixture(scope="module")
def qwen3_next_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def test_qwen3_next_config_reads_the_experts_beside_the_layer_kinds(qwen3_next_folder):
    config = ModelConfig.from_file(qwen3_next_folder / "config.json")
    assert (config.attention_layers, config.linear_layers) == ((1, 3), (0, 2))
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_size) == (8, 2, 48)
    assert [config.layer_is_sparse(i) for i in range(4)] == [False, True, True, True]


@pytest.mark.parametrize("paged", [False, True])
def test_qwen3_next_logits_match_transformers_fp32(qwen3_next_folder, paged):
    """Qwen3-Next's fused linear-layer projections (qkvz, ba), its routed experts and the
    gated shared expert beside them."""
    model = load(qwen3_next_folder)
    ids = random_ids(40, seed=1, low=3)
    ours = kvchat_logits(model, ids.tolist(), paged=paged)
    assert rel_err(ours, hf_logits(qwen3_next_folder, ids)) < 1e-4


def test_qwen3_next_bf16_error_within_transformers_own(qwen3_next_folder):
    ours, theirs = bf16_errors(qwen3_next_folder)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


@pytest.fixture(scope="module")
def qwen35_moe_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen35_moe"), "qwen3_5_moe_text")


def test_qwen35_moe_config_makes_every_layer_sparse_with_a_shared_expert(qwen35_moe_folder):
    """Its config has no routing keys (no mlp_only_layers, decoder_sparse_step,
    norm_topk_prob, nor a dense intermediate_size): transformers routes every layer
    through experts, renormalized, beside a shared one."""
    raw = json.loads((qwen35_moe_folder / "config.json").read_text())
    assert not {"intermediate_size", "norm_topk_prob", "mlp_only_layers"} & set(raw)
    config = ModelConfig.from_dict(raw)
    assert config.hybrid and config.unit_offset_norms and config.qk_norm
    assert (config.attention_layers, config.linear_layers) == ((1, 3), (0, 2))
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_size) == (8, 2, 48)
    assert config.norm_topk_prob and all(config.layer_is_sparse(i) for i in range(4))


@pytest.mark.parametrize("paged", [False, True])
def test_qwen35_moe_logits_match_transformers_fp32(qwen35_moe_folder, paged):
    """Qwen3.5's separate linear-layer projections, the stacked experts as the file holds
    them, and the gated shared expert, in every layer."""
    model = load(qwen35_moe_folder)
    assert model.transformer.layers[0].experts.gate_up.shape == (8, 64, 64)  # [E, 2 I, hidden]
    ids = random_ids(40, seed=1, low=3)
    ours = kvchat_logits(model, ids.tolist(), paged=paged)
    assert rel_err(ours, hf_logits(qwen35_moe_folder, ids)) < 1e-4


def test_qwen35_moe_bf16_error_within_transformers_own(qwen35_moe_folder):
    ours, theirs = bf16_errors(qwen35_moe_folder)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_qwen35_moe_a_batch_of_sequences_equals_each_alone(qwen35_moe_folder):
    """The experts group the batch's tokens across sequences; each run's linear layers
    keep to its own state."""
    for ids, ours, alone in batched_and_alone(qwen35_moe_folder):
        assert rel_err(ours, alone) < 1e-5
        assert rel_err(ours, hf_logits(qwen35_moe_folder, torch.tensor(ids))) < 1e-4


def test_qwen35_moe_experts_one_tensor_each_give_the_same_logits(qwen35_moe_folder, tmp_path):
    """transformers' save_pretrained writes the experts one tensor an expert and projection
    (`mlp.experts.{e}.gate_proj.weight`, ...) unless told otherwise: read as well as the
    stacked ones, to the same logits."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "per-expert"
    folder.mkdir()
    for path in qwen35_moe_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        experts = name.removesuffix("gate_up_proj")
        down = tensors.pop(f"{experts}down_proj")
        for e, (gate_up, down_e) in enumerate(zip(tensors.pop(name), down, strict=True)):
            gate, up = gate_up.chunk(2)
            for part, weight in (("gate", gate), ("up", up), ("down", down_e)):
                tensors[f"{experts}{e}.{part}_proj.weight"] = weight.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in tensors
    ids = random_ids(40, seed=3, low=3)
    split = kvchat_logits(load(folder), ids.tolist(), paged=True)
    assert rel_err(split, kvchat_logits(load(qwen35_moe_folder), ids.tolist(), paged=True)) < 1e-6
    assert rel_err(split, hf_logits(folder, ids)) < 1e-4  # transformers stacks them on load


def test_qwen35_moe_experts_that_disagree_with_the_config_are_refused(qwen35_moe_folder, tmp_path):
    folder = tmp_path / "edited"
    folder.mkdir()
    for path in qwen35_moe_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "moe_intermediate_size": 16}))
    with pytest.raises(ModelLoadError, match="stacked experts"):
        load(folder)


def test_a_vision_language_qwen35_moe_runs_its_text_model(qwen35_moe_folder, tmp_path):
    """Qwen3.5-MoE's hub layout: the text model's stacked experts under
    `model.language_model.*` beside a vision tower and an mtp head; kvchat computes what
    Qwen3_5MoeForConditionalGeneration computes for text."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    folder = write_vision_language_qwen35(tmp_path / "qwen35-moe-vl", qwen35_moe_folder, moe=True)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe"
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    names = {name for name, _ in read_tensors(folder, torch.float32, torch.device("cpu"))}
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    model = load(folder)
    assert model.config.model_type == "qwen3_5_moe_text" and model.config.shared_expert_size == 48
    ids = random_ids(40, seed=7, low=3)
    reference = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = reference.eval()(input_ids=ids[None]).logits[0].float()
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-4
