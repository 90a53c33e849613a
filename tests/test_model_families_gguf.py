"""GGUFs of the families beyond Llama, made by llama.cpp's own converter from
random-weight Hugging Face folders of each family's shapes: kvchat reads the file to
the logits transformers computes from the folder.

The folders carry the default model's tokenizer (SmolLM2's byte-level BPE, which the
converter recognizes), so the converter writes a real vocabulary and chat template.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.llama_cpp_convert import ConverterUnavailable, convert, requantize
from tests.llama_server_agreement import assert_llama_server_writes_kvchats_tokens
from tests.parity_helpers import kvchat_logits, native_error, rel_err
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


# family -> what the file must say of it once read back (its config, the folder's)
FAMILIES = {
    # llama.cpp's fixed pattern (five windowed layers to one global), both rotary bases
    "gemma3_text": lambda c, hf: (
        (c.layer_windows, c.rope_theta, c.local_rope_theta, c.query_pre_attn_scalar)
        == (hf.layer_windows, hf.rope_theta, hf.local_rope_theta, hf.query_pre_attn_scalar)
    ),
    "qwen3": lambda c, _: c.qk_norm and c.head_dim == 32,  # head_dim from key_length
    "smollm3": lambda c, _: c.rope_layers == (True, True, True, False),  # llama.cpp's fixed 4
    # expert counts from the metadata; llama.cpp renormalizes the chosen experts' weights
    "qwen3_moe": lambda c, hf: (
        (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob)
        == (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, True)
        and c.mlp_only_layers == hf.mlp_only_layers == ()
    ),
    # llama.cpp's fixed pattern (windowed layers first), YaRN untruncated, the experts
    "gpt_oss": lambda c, hf: (
        (c.layer_windows, c.rope_scaling, c.num_experts, c.num_experts_per_tok)
        == (hf.layer_windows, hf.rope_scaling, hf.num_experts, hf.num_experts_per_tok)
    ),
    # YaRN and the query scaling from the file
    "ministral3": lambda c, hf: (
        (c.rope_scaling, c.query_scaling_beta) == (hf.rope_scaling, hf.query_scaling_beta)
    ),
    # rotary dimensions, LongRoPE's factor sets and attention factor from the file
    "phi3": lambda c, hf: (c.rotary_dim, c.rope_scaling) == (12, hf.rope_scaling),
}
# the context each family runs in here: Phi-3's short LongRoPE set, as transformers uses
# for a prompt this short (tests/test_model_phi3.py)
CONTEXT = {"phi3": PHI3_ORIGINAL_CONTEXT}
# Q8_0's rounding moves the tiny Gemma's logits by 0.13 and the tiny gpt-oss's by 0.22 in
# transformers itself (their weights rounded the same way: layers of scaled-up random
# weights amplify it); the f32 file is the exact check
Q8_TOLERANCE = {"gemma3_text": 0.2, "gpt_oss": 0.3}
# llama.cpp's qwen3moe has no dense layers (the converter refuses mlp_only_layers)
FOLDER_OPTIONS = {"qwen3_moe": {"mlp_only_layers": []}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_folder(request, tmp_path_factory, default_tokenizer):
    from tests.tiny_models import write_tiny_model

    folder = tmp_path_factory.mktemp(request.param)
    write_tiny_model(
        folder,
        request.param,
        vocab_size=len(default_tokenizer),
        with_tokenizer=False,
        **FOLDER_OPTIONS.get(request.param, {}),
    )
    default_tokenizer.save_pretrained(folder)
    if request.param == "phi3":  # llama.cpp's Phi-3 converter reads a GPT-2 BPE by this name
        config_file = folder / "tokenizer_config.json"
        tokenizer_config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**tokenizer_config, "tokenizer_class": "GPT2Tokenizer"}))
    return request.param, folder


def hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.parametrize(("outtype", "tolerance"), [("f32", 1e-4), ("q8_0", 0.05)])
def test_a_gguf_from_llama_cpps_converter_gives_transformers_logits(
    family_folder, tmp_path, outtype, tolerance
) -> None:
    family, folder = family_folder
    try:
        gguf = convert(folder, tmp_path / f"{family}-{outtype}.gguf", outtype)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    model = load_model(str(gguf), dtype="float32", device="cpu")
    assert model.config.model_type == family and FAMILIES[family](
        model.config, ModelConfig.from_file(folder / "config.json")
    )
    if family in CONTEXT:
        model.transformer.fit_context(CONTEXT[family])
    ids = torch.randint(
        0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)
    )
    error = rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids))
    if outtype == "q8_0":
        tolerance = Q8_TOLERANCE.get(family, tolerance)
    assert error < tolerance, error
    # the file's vocabulary and template: the prompt renders as the folder's does
    folder_model = load_model(str(folder), dtype="float32", device="cpu")
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert model.renderer.prompt_ids(chat) == folder_model.renderer.prompt_ids(chat)


def test_a_4_bit_gguf_keeps_its_layers_4_bit_and_gives_the_f32_files_logits(
    family_folder, tmp_path
) -> None:
    """The layers of a Q4_0 file multiply through kvchat's 4-bit kernels (Phi-3's fused
    q/k/v and gate/up matrices as they are in the file; Qwen3-MoE's experts one by one,
    each sliced from its stacked tensor), and give what the same file's weights
    dequantized give."""
    family, folder = family_folder
    try:
        f32 = convert(folder, tmp_path / f"{family}-f32.gguf", "f32")
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    experts = "Q4_0" if family == "qwen3_moe" else None  # gpt-oss's come in MXFP4
    q4 = requantize(f32, tmp_path / f"{family}-q4_0.gguf", experts=experts)
    native = load_model(str(q4), dtype="float32", device="cpu", weights="native")
    dense = load_model(str(q4), dtype="float32", device="cpu", weights="bf16")
    layer = native.transformer.layers[0]
    assert "Q4" in type(layer.qkv).__name__
    if family == "qwen3_moe":
        gate_up, down = layer.experts.linears[0]
        assert "Q4" in type(gate_up).__name__ and "Q4" in type(down).__name__
        assert dense.transformer.layers[0].experts.linears is None
    elif layer.experts is None:
        assert "Q4" in type(layer.gate_up).__name__
    assert "Q4" not in type(dense.transformer.layers[0].qkv).__name__
    for model in (native, dense):
        if family in CONTEXT:
            model.transformer.fit_context(CONTEXT[family])
    error = native_error(native, dense)
    assert error < 1e-4, error


def test_llama_server_writes_the_same_greedy_tokens_from_the_same_file(family_folder, tmp_path):
    """llama.cpp's own engine on the converter's file: its greedy continuation of a
    prompt of ids is kvchat's (a 256-token context, so Phi-3 runs LongRoPE's short set
    in both)."""
    family, folder = family_folder
    if family == "phi3":
        pytest.skip(
            "llama.cpp's phi3 loader looks up Phi's own special tokens, which the default "
            "model's tokenizer these files carry lacks (it refuses the file)"
        )
    try:
        gguf = convert(folder, tmp_path / f"{family}-f32.gguf", "f32")
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    assert_llama_server_writes_kvchats_tokens(gguf, family)


def test_gpt_oss_experts_in_mxfp4_decode_as_gguf_py_decodes_them(default_tokenizer, tmp_path):
    """gpt-oss's GGUFs hold their experts in MXFP4 (a power-of-two scale and 4-bit E2M1
    codes per 32 values): kvchat decodes them as gguf-py's reference does, bit for bit,
    and runs the file. (llama-server is no oracle here: on a CPU it multiplies MXFP4 by
    activations rounded to 8 bits, which moves the tiny model's near-tied tokens.)"""
    import gguf as gguf_py

    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(
        tmp_path / "gpt-oss", "gpt_oss", vocab_size=len(default_tokenizer), with_tokenizer=False
    )
    default_tokenizer.save_pretrained(folder)
    try:
        f32 = convert(folder, tmp_path / "gpt-oss-f32.gguf", "f32")
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    mxfp4 = requantize(f32, tmp_path / "gpt-oss-mxfp4.gguf", qtype=None, experts="MXFP4")
    reader = gguf_py.GGUFReader(mxfp4)
    gate = next(t for t in reader.tensors if t.name == "blk.1.ffn_gate_exps.weight")
    assert gate.tensor_type == gguf_py.GGMLQuantizationType.MXFP4
    expected = torch.from_numpy(gguf_py.quants.dequantize(gate.data, gate.tensor_type))
    model = load_model(str(mxfp4), dtype="float32", device="cpu")
    gate_rows = model.transformer.layers[1].experts.gate_up[:, : expected.shape[1]]
    assert torch.equal(gate_rows, expected)  # [experts, I, hidden], gate before up
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    logits = kvchat_logits(model, ids, paged=True)
    assert logits.shape == (40, len(default_tokenizer)) and torch.isfinite(logits).all()
