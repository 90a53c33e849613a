"""gpt-oss against transformers: learned attention sinks in every head's softmax, every
other layer windowed, q/k/v/o biases, YaRN without truncation, and top-k experts from a
biased router with a clamped SwiGLU.

The tiny model's window is 16 tokens (`GPT_OSS_WINDOW`) and its original context 64, so
the prompts here run past both; each feature left out is shown to change the logits.
"""

from __future__ import annotations

import pytest
import torch

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.errors import UsageError
from kvchat.model.batch import ForwardBatch, NoCacheAttention
from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.engine_helpers import generate
from tests.parity_helpers import hf_logits, hf_model, kvchat_logits, random_ids, rel_err
from tests.tiny_models import GPT_OSS_WINDOW, write_tiny_model


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss")


def test_config_reads_the_layers_sinks_and_routing(gpt_oss_folder):
    config = ModelConfig.from_file(gpt_oss_folder / "config.json")
    assert config.layer_windows == (GPT_OSS_WINDOW, None) * 2
    assert config.attention_sinks and config.attention_bias and config.sliding_window is None
    assert (config.num_experts, config.num_experts_per_tok, config.expert_kind) == (
        8, 2, "gpt_oss",
    )  # fmt: skip
    scaling = config.rope_scaling
    assert scaling is not None and scaling.kind == "yarn" and not scaling.truncate


@pytest.mark.parametrize("paged", [False, True])
def test_logits_match_transformers_fp32(gpt_oss_folder, paged):
    model = load_model(str(gpt_oss_folder), dtype="float32", device="cpu")
    ids = random_ids(100, seed=1)
    ours = kvchat_logits(model, ids.tolist(), paged=paged)
    assert rel_err(ours, hf_logits(gpt_oss_folder, ids)) < 1e-4


@pytest.mark.parametrize("left_out", ["sinks", "window", "expert bias"])
def test_leaving_a_feature_out_gives_other_logits(gpt_oss_folder, left_out):
    """The check above can fail: each of these, taken away, moves the logits far."""
    model = load_model(str(gpt_oss_folder), dtype="float32", device="cpu")
    for layer in model.transformer.layers:
        if left_out == "sinks":
            layer.sinks = None
        elif left_out == "window":
            layer.window = None
        else:
            layer.experts.gate_up_bias = None
    ids = random_ids(100, seed=1)
    ours = kvchat_logits(model, ids.tolist(), paged=True)
    assert rel_err(ours, hf_logits(gpt_oss_folder, ids)) > 0.01


def test_bf16_error_within_transformers_own(gpt_oss_folder):
    ids = random_ids(80, seed=2)
    exact = hf_logits(gpt_oss_folder, ids)
    theirs = rel_err(hf_logits(gpt_oss_folder, ids, torch.bfloat16), exact)
    model = load_model(str(gpt_oss_folder), dtype="bfloat16", device="cpu")
    ours = rel_err(kvchat_logits(model, ids.tolist(), paged=True), exact)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def test_a_batch_of_sequences_gives_each_its_logits_alone(gpt_oss_folder):
    model = load_model(str(gpt_oss_folder), dtype="float32", device="cpu")
    runs = [random_ids(n, seed).tolist() for n, seed in ((30, 1), (7, 2), (45, 3))]
    batch = ForwardBatch.from_runs(runs, [0] * len(runs), all_logits=True)
    together = model.transformer.forward(batch, NoCacheAttention(batch))
    start = 0
    for ids in runs:
        alone = kvchat_logits(model, ids, paged=False)
        assert rel_err(together[start : start + len(ids)], alone) < 1e-5
        start += len(ids)


@pytest.mark.parametrize("attention", ["native", "sdpa"])
def test_greedy_text_through_the_engine_equals_transformers(gpt_oss_folder, attention):
    ids = random_ids(70, seed=3).tolist()
    with torch.no_grad():
        theirs = (
            hf_model(gpt_oss_folder)
            .generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None)[
                0, len(ids) :
            ]
            .tolist()
        )
    model = load_model(str(gpt_oss_folder), dtype="float32", device="cpu")
    ours = generate(
        model, ids, max_tokens=24, ignore_eos=True, attention=attention, step_token_budget=8,
        max_batch=4,
    )  # fmt: skip
    assert ours == theirs


def test_flex_attention_on_a_cpu_is_refused_with_what_to_use(gpt_oss_folder):
    """flex computes the sinks from its kernel's log-sum-exp, which torch's compiled CPU
    kernel does not return (on CUDA it runs: tests/test_flex_attention.py)."""
    model = load_model(str(gpt_oss_folder), dtype="float32", device="cpu")
    with pytest.raises(UsageError, match="--attention native"):
        Engine(model, EngineConfig(attention="flex"), start=False)


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert tensor [E, columns, rows] (transformers' layout) as OpenAI's checkpoints
    store it: blocks [E, rows, columns / 32, 16] and scales [E, rows, columns / 32]."""
    from kvchat.model.safetensors_folder import FP4_VALUES

    rows = weight.transpose(1, 2)  # [E, rows, columns]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.floor(torch.log2(largest)) - 2  # the group's largest / 2^e in [4, 8)
    values = torch.tensor(FP4_VALUES)
    codes = (groups / 2.0**exponent).unsqueeze(-1).sub(values).abs().argmin(-1)  # nearest
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent.squeeze(-1) + 127).to(torch.uint8)


def test_a_checkpoint_with_mxfp4_experts_reads_as_transformers_dequantizes_it(
    gpt_oss_folder, tmp_path
):
    """gpt-oss as OpenAI ships it: experts in MXFP4 (`*_blocks`, `*_scales`). kvchat's
    logits on that folder equal transformers' on its weights dequantized by transformers'
    own MXFP4 code."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(gpt_oss_folder, folder)
    weights = load_file(folder / "model.safetensors")
    dequantized = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_mxfp4(weights.pop(name))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(weights, folder / "model.safetensors")

    reference = AutoModelForCausalLM.from_pretrained(gpt_oss_folder, dtype=torch.float32).eval()
    reference.load_state_dict({**reference.state_dict(), **dequantized})
    ids = random_ids(60, seed=4)
    with torch.no_grad():
        theirs = reference(ids[None]).logits[0]
    model = load_model(str(folder), dtype="float32", device="cpu")
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-4
    # and the rounding was real: these are not the folder's own experts
    assert rel_err(theirs, hf_logits(gpt_oss_folder, ids)) > 1e-3
