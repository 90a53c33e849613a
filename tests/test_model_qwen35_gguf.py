"""GGUFs of the hybrid families, Qwen3.5 (text; llama.cpp's `qwen35`), Qwen3.5-MoE (text;
`qwen35moe`) and Qwen3-Next (`qwen3next`), made by llama.cpp's own converter from
random-weight Hugging Face folders: kvchat reads every tensor back to the folder's and the
file to the folder's logits.

The converter exports multi-token-prediction (nextn) blocks unless told `--no-mtp`, and
asserts a Qwen3-Next or Qwen3.5 folder without them has some: these folders (as
transformers writes them, no `mtp.*` weights) convert with `--no-mtp`; a Qwen3.5 and a
Qwen3.5-MoE folder are given an MTP block, converted with it, and kvchat skips it. The tiny
models have more value heads than key heads (4 to 2), so the converter's reordering of
Qwen3.5's value heads is undone for real; Qwen3-Next's has no dense layer, which llama.cpp's
converter would not take. Qwen3.5-MoE's folder holds its experts stacked, gate and up
fused, as the hub's checkpoints do; the converter splits gate from up.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.llama_cpp_convert import ConverterUnavailable, convert, llama_quantize, requantize
from tests.parity_helpers import kvchat_logits, native_error, rel_err

pytestmark = pytest.mark.real_model

NO_MTP = ("--no-mtp",)
FOLDER_OPTIONS = {"qwen3_next": {"mlp_only_layers": []}}
# the families whose experts a 4-bit file holds in Q4_0 too (llama-quantize's choice)
WITH_EXPERTS = ("qwen3_5_moe_text", "qwen3_next")


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


def tiny_folder(folder, family: str, tokenizer, **options):
    from tests.tiny_models import write_tiny_model

    write_tiny_model(
        folder,
        family,
        vocab_size=len(tokenizer),
        with_tokenizer=False,
        **{**FOLDER_OPTIONS.get(family, {}), **options},
    )
    tokenizer.save_pretrained(folder)
    return folder


def converted(folder, out, options=NO_MTP):
    try:
        return convert(folder, out, "f32", options)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def hybrid_gguf(request, tmp_path_factory, default_tokenizer):
    """(family, the Hugging Face folder, llama.cpp's f32 GGUF of it)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder = tiny_folder(root / "hf", family, default_tokenizer)
    return family, folder, converted(folder, root / f"{family}-f32.gguf")


def test_the_files_tensors_and_config_are_the_folders(hybrid_gguf) -> None:
    """Every tensor back as the checkpoint holds it (norms without the converter's 1 + w,
    A_log from -exp(A_log), the convolution's kernel 3-d again, Qwen3.5's value heads in
    their grouped order, Qwen3-Next's in_proj_qkvz fused again; Qwen3.5-MoE's experts,
    which kvchat reads one each, stacked again to compare), and the config's layer kinds,
    DeltaNet shape, experts and rotary as the folder's."""
    from safetensors.torch import load_file

    from kvchat.model.gguf.convert import gguf_state_dict, gguf_to_hf_config
    from kvchat.model.gguf.file import GGUFFile

    family, folder, gguf = hybrid_gguf
    file = GGUFFile.open(gguf)
    ours = dict(gguf_state_dict(file, torch.float32))
    theirs = load_file(folder / "model.safetensors")
    if family == "qwen3_5_moe_text":
        ours = stacked_experts(ours)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, name
        torch.testing.assert_close(ours[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    config = ModelConfig.from_dict(gguf_to_hf_config(file))
    hf = ModelConfig.from_file(folder / "config.json")
    assert config.model_type == hf.model_type == family
    assert (config.layer_kinds, config.delta_net) == (hf.layer_kinds, hf.delta_net)
    assert (config.rotary_dim, config.rope_theta, config.head_dim) == (
        hf.rotary_dim,
        hf.rope_theta,
        hf.head_dim,
    )
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_size) == (
        hf.num_experts,
        hf.num_experts_per_tok,
        hf.shared_expert_size,
    )


def hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def test_a_gguf_from_llama_cpps_converter_gives_the_folders_logits(hybrid_gguf) -> None:
    """float32 logits of the file, a prefill chunk then decode steps (the DeltaNet state
    carried between them), as kvchat computes them from the folder and as transformers
    does; the file's vocabulary and template render a chat as the folder's."""
    family, folder, gguf = hybrid_gguf
    model = load_model(str(gguf), dtype="float32", device="cpu")
    folder_model = load_model(str(folder), dtype="float32", device="cpu")
    assert model.config.model_type == family
    ids = torch.randint(
        0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(1)
    )
    ours = kvchat_logits(model, ids.tolist(), paged=True)
    assert rel_err(ours, kvchat_logits(folder_model, ids.tolist(), paged=True)) < 1e-4
    assert rel_err(ours, hf_logits(folder, ids)) < 1e-4
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert model.renderer.prompt_ids(chat) == folder_model.renderer.prompt_ids(chat)


def stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each layer's experts, one each under Hugging Face's per-expert names
    as kvchat reads a file's, stacked as transformers holds them: [experts, gate | up,
    hidden] and [experts, hidden, intermediate]."""
    weights = dict(weights)
    for name in [n for n in weights if n.endswith("experts.0.gate_proj.weight")]:
        prefix = name.removesuffix("0.gate_proj.weight")
        count = sum(1 for n in weights if n.startswith(prefix) and n.endswith(".gate_proj.weight"))
        gate, up, down = (
            [weights.pop(f"{prefix}{e}.{p}_proj.weight") for e in range(count)]
            for p in ("gate", "up", "down")
        )
        weights[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(gate, up, strict=True)]
        )
        weights[prefix + "down_proj"] = torch.stack(down)
    return weights


def transformers_on_the_files_weights(folder, gguf, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits from the folder's model with the file's weights, dequantized
    as kvchat reads them (the experts stacked as transformers holds them)."""
    from transformers import AutoModelForCausalLM

    from kvchat.model.gguf.convert import gguf_state_dict
    from kvchat.model.gguf.file import GGUFFile

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    weights = stacked_experts(gguf_state_dict(GGUFFile.open(gguf), torch.float32))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def test_a_q8_0_gguf_gives_transformers_logits_on_its_weights(hybrid_gguf) -> None:
    """The converter's Q8_0 file (its matrices 8-bit, the convolution, norms, A and
    dt_bias kept f32): kvchat's logits, the 8-bit matrices through its 8-bit kernels, are
    transformers' on the same rounded weights. (Against the f32 file they move by 0.09,
    and by 0.5 for Qwen3-Next, whose rounding flips some experts' choice: random tiny
    layers amplify it.)"""
    family, folder, f32 = hybrid_gguf
    try:
        q8 = convert(folder, f32.with_name(f"{family}-q8_0.gguf"), "q8_0", NO_MTP)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    model = load_model(str(q8), dtype="float32", device="cpu")
    assert "Q8" in type(model.transformer.layers[1].qkv).__name__
    ids = torch.randint(
        0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(4)
    )
    error = rel_err(
        kvchat_logits(model, ids.tolist(), paged=True),
        transformers_on_the_files_weights(folder, q8, ids),
    )
    assert error < 1e-4, error


def test_a_4_bit_gguf_keeps_its_layers_4_bit_and_gives_the_dequantized_logits(
    hybrid_gguf, tmp_path
) -> None:
    """The f32 file's matrices in Q4_0 (as llama-quantize makes them; the convolution
    kernels stay f32; the MoE models' experts Q4_0 too): the full-attention layers' q/k/v
    and o, Qwen3.5's gate/up, the MoE models' experts and shared gate/up, the Gated
    DeltaNet's fused in_proj and Qwen3-Next's out_proj multiply through kvchat's 4-bit
    kernels, the rest is dequantized, and the logits are those of the same file's weights
    all dequantized. (Qwen3.5's out_proj stays dense here: its value heads, reordered by
    the converter, are 16 columns, half a Q4_0 block; wider heads: below.)"""
    family, _, f32 = hybrid_gguf
    experts = "Q4_0" if family in WITH_EXPERTS else None
    q4 = requantize(f32, tmp_path / f"{family}-q4_0.gguf", experts=experts)
    native = load_model(str(q4), dtype="float32", device="cpu", weights="native")
    dense = load_model(str(q4), dtype="float32", device="cpu", weights="bf16")
    layer = native.transformer.layers[1]
    assert "Q4" in type(layer.qkv).__name__ and "Q4" in type(layer.gate_up).__name__
    assert "Q4" not in type(dense.transformer.layers[1].qkv).__name__
    delta_net = native.transformer.layers[0].delta_net
    assert "Q4" in type(delta_net.in_proj).__name__
    assert ("Q4" in type(delta_net.out_proj).__name__) == (family == "qwen3_next")
    assert "Q4" not in type(dense.transformer.layers[0].delta_net.in_proj).__name__
    if family in WITH_EXPERTS:  # each expert's, and the shared one's gate/up
        gate_up, down = layer.experts.linears[0]
        assert "Q4" in type(gate_up).__name__ and "Q4" in type(down).__name__
        assert dense.transformer.layers[1].experts.linears is None
    error = native_error(native, dense)
    assert error < 1e-4, error


def with_an_mtp_block(folder) -> None:
    """Give a tiny Qwen3.5 (or Qwen3.5-MoE) folder a multi-token-prediction block as
    Qwen3.5's checkpoints hold it (`mtp.*`: a full-attention decoder layer, with the
    experts where the model has them, the fc joining embedding and hidden state, their
    norms), random, and say so in its config (`mtp_num_hidden_layers`)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    generator = torch.Generator().manual_seed(5)
    mtp = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator) * 0.02,
        "mtp.pre_fc_norm_embedding.weight": torch.rand(hidden, generator=generator),
        "mtp.pre_fc_norm_hidden.weight": torch.rand(hidden, generator=generator),
        "mtp.norm.weight": torch.rand(hidden, generator=generator),
    }
    for name, tensor in weights.items():  # the last (full-attention) layer's shapes
        if name.startswith("model.layers.3."):
            mtp[name.replace("model.layers.3.", "mtp.layers.0.")] = torch.randn(
                tensor.shape, generator=generator
            )
    save_file({**weights, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))


@pytest.mark.parametrize(
    ("family", "arch"), [("qwen3_5_text", "qwen35"), ("qwen3_5_moe_text", "qwen35moe")]
)
def test_a_qwen35_gguf_with_its_mtp_block_runs_without_it(
    tmp_path, default_tokenizer, family: str, arch: str
) -> None:
    """The converter's default: the MTP block as a fifth block (`blk.4.*`, its `nextn.*`
    tensors, Qwen3.5-MoE's with its experts) and `nextn_predict_layers`; kvchat runs the
    four decoder layers, to the logits transformers computes from the folder (which
    leaves `mtp.*` unread too)."""
    from kvchat.model.gguf.file import GGUFFile

    folder = tiny_folder(tmp_path / "hf", family, default_tokenizer)
    with_an_mtp_block(folder)
    gguf = converted(folder, tmp_path / "with-mtp.gguf", options=())
    file = GGUFFile.open(gguf)
    assert file.metadata[f"{arch}.nextn_predict_layers"] == 1
    assert file.metadata[f"{arch}.block_count"] == 5
    assert "blk.4.nextn.eh_proj.weight" in file.tensors
    if family == "qwen3_5_moe_text":
        assert "blk.4.ffn_gate_exps.weight" in file.tensors
    model = load_model(str(gguf), dtype="float32", device="cpu")
    assert model.config.num_layers == 4
    ids = torch.randint(3, 1000, (32,), generator=torch.Generator().manual_seed(2))
    error = rel_err(kvchat_logits(model, ids.tolist(), paged=True), hf_logits(folder, ids))
    assert error < 1e-4, error


def test_llama_server_writes_the_same_greedy_tokens_from_the_same_file(hybrid_gguf) -> None:
    """llama.cpp's own engine on the converter's file: its greedy continuation of a
    prompt of ids is kvchat's."""
    from tests.llama_server_agreement import assert_llama_server_writes_kvchats_tokens

    family, _, gguf = hybrid_gguf
    assert_llama_server_writes_kvchats_tokens(gguf, family)


# Qwen3.5's Gated DeltaNet at widths llama-quantize's K-quants take (rows of 256) and with
# value heads of 128 columns, as Qwen3.5's: out_proj's reordered heads are whole blocks
WIDE = dict(hidden_size=256, intermediate_size=256, linear_value_head_dim=128)


@pytest.fixture(scope="module")
def wide_qwen35_gguf(tmp_path_factory, default_tokenizer):
    """(the folder, llama.cpp's f32 GGUF of it) for a Qwen3.5 of `WIDE`'s widths."""
    root = tmp_path_factory.mktemp("qwen35-wide")
    folder = tiny_folder(root / "hf", "qwen3_5_text", default_tokenizer, **WIDE)
    return folder, converted(folder, root / "wide-f32.gguf")


def dequantized(linear) -> torch.Tensor:
    """The float32 weight a layer multiplies by, its parts (a `StackedLinear`'s) stacked."""
    from kvchat.model.linear import DenseLinear, StackedLinear

    if isinstance(linear, StackedLinear):
        return torch.cat([dequantized(part) for part in linear.parts])
    if isinstance(linear, DenseLinear):
        return linear.weight.float()
    return linear.dequantized().float()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])
def test_llama_quantizes_4_bit_gated_deltanet_stays_quantized_with_its_heads_in_order(
    wide_qwen35_gguf, tmp_path, qtype: str
) -> None:
    """llama-quantize's own Q4_0 and Q4_K_M files: each Gated DeltaNet layer's in_proj
    (q/k/v, z, b, a) and out_proj are built from the file's blocks, in float32 and in bf16
    (where Q4_K keeps its super-scales, multiplied out for out_proj's columns), and
    multiply by exactly the file's weights in the checkpoint's order, value heads grouped
    again (the converted dense weights); the logits are the dequantized file's."""
    from kvchat.model.config import ModelConfig
    from kvchat.model.gguf.convert import gguf_state_dict, gguf_to_hf_config
    from kvchat.model.gguf.file import GGUFFile
    from kvchat.model.gguf.weights import quantized_linears
    from kvchat.model.linear import DenseLinear

    _, f32 = wide_qwen35_gguf
    try:
        path = llama_quantize(f32, tmp_path / f"wide-{qtype}.gguf", qtype)
    except ConverterUnavailable as exc:
        pytest.skip(f"llama-quantize is not built here: {exc}")
    file = GGUFFile.open(path)
    config = ModelConfig.from_dict(gguf_to_hf_config(file))
    exact = dict(gguf_state_dict(file, torch.float32))
    linear_layers = [i for i in range(config.num_layers) if config.layer_is_linear(i)]
    for dtype in (torch.float32, torch.bfloat16):
        built = quantized_linears(file, config, dtype, dict(gguf_state_dict(file, dtype)))
        for i in linear_layers:
            prefix = f"model.layers.{i}.linear_attn."
            in_proj, out_proj = built[prefix + "in_proj"], built[prefix + "out_proj"]
            assert not isinstance(out_proj, DenseLinear)
            parts = [exact[f"{prefix}in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]
            torch.testing.assert_close(dequantized(in_proj), torch.cat(parts), rtol=0, atol=0)
            want = exact[prefix + "out_proj.weight"]
            torch.testing.assert_close(dequantized(out_proj), want, rtol=0, atol=0)
    native = load_model(str(path), dtype="float32", device="cpu", weights="native")
    dense = load_model(str(path), dtype="float32", device="cpu", weights="bf16")
    delta_net = native.transformer.layers[0].delta_net
    assert not isinstance(delta_net.in_proj, DenseLinear)
    assert not isinstance(delta_net.out_proj, DenseLinear)
    error = native_error(native, dense)
    assert error < 1e-4, error


def test_a_4_bit_gated_deltanet_with_dense_b_and_a_keeps_them_beside(hybrid_gguf, tmp_path):
    """A file whose DeltaNet b and a (`ssm_beta` / `ssm_alpha`, Qwen3-Next's `ssm_ba`)
    stay f32 beside 4-bit q/k/v and z: the fused in_proj is the 4-bit part and a dense
    one side by side, as built and as read back from the prepared-layers cache, and the
    logits are the dequantized file's."""
    from kvchat.model.linear import DenseLinear, StackedLinear
    from kvchat.model.loader import NATIVE_CACHE_VERSION
    from kvchat.model.quantized_linear import Q4Linear

    family, _, f32 = hybrid_gguf
    small = ("ssm_beta", "ssm_alpha", "ssm_ba")
    q4 = requantize(f32, tmp_path / f"{family}-dense-ba.gguf", keep=small)
    built, cached = (
        load_model(str(q4), dtype="float32", device="cpu", weights="native") for _ in range(2)
    )
    assert (built.folder / f"native-q4-v{NATIVE_CACHE_VERSION}-float32.safetensors").exists()
    dense = load_model(str(q4), dtype="float32", device="cpu", weights="bf16")
    ids = torch.randint(
        0, dense.config.vocab_size, (48,), generator=torch.Generator().manual_seed(4)
    )
    want = kvchat_logits(dense, ids.tolist(), paged=True)
    for model in (built, cached):
        in_proj = model.transformer.layers[0].delta_net.in_proj
        assert isinstance(in_proj, StackedLinear)
        assert [type(part) for part in in_proj.parts] == [Q4Linear, DenseLinear]
        error = rel_err(kvchat_logits(model, ids.tolist(), paged=True), want)
        assert error < 1e-4, error
