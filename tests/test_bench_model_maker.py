"""The bench's models of real shape: made once (random weights, llama.cpp's converter and
llama-quantize), reused, listed and removed; refused with a reason when the machine is
too small. A tiny shape stands in for the real ones, which take minutes and gigabytes."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvchat.bench import model_maker
from kvchat.bench.model_shapes import SHAPES, TINY_LLAMA, ModelShape
from kvchat.errors import KvchatError, UsageError
from kvchat.paths import app_paths
from tests.shared_cache import TEST_CACHE

pytestmark = pytest.mark.real_model  # the default model's tokenizer goes into the folder


@pytest.fixture(scope="module")
def quantizer_server():
    """A llama-server build with llama-quantize beside it (built once, as the tests'
    servers are)."""
    from tests.servers import Unavailable, llama_server_binary

    try:
        return llama_server_binary()
    except Unavailable as exc:
        pytest.skip(f"llama.cpp cannot be built here: {exc}")


def test_a_shape_is_made_once_in_both_quantizations_and_kvchat_runs_it(
    default_gguf_path, quantizer_server
):
    import gguf as gguf_py

    from kvchat.model.loader import load_model

    cache = app_paths().cache_dir  # this test's own (KVCHAT_HOME)
    said: list[str] = []
    made = model_maker.make_shape(
        TINY_LLAMA,
        cache,
        default_gguf_path,
        said.append,
        llama_server=str(quantizer_server),
        tools_cache=TEST_CACHE,
    )
    assert made.folder == model_maker.shapes_dir(cache) / "tiny-llama"
    # only the 4-bit files are kept: the safetensors and the bf16 GGUF are gone
    assert sorted(p.name for p in made.folder.iterdir()) == [
        "done", "tiny-llama-Q4_0.gguf", "tiny-llama-Q4_K_M.gguf",
    ]  # fmt: skip
    # what llama-quantize wrote: the file type asked (a tiny shape's rows of 64 are too
    # short for K-quant blocks of 256, so its Q4_K_M tensors fall back to other types)
    for quant, file_type in (("Q4_0", gguf_py.LlamaFileType.MOSTLY_Q4_0),
                             ("Q4_K_M", gguf_py.LlamaFileType.MOSTLY_Q4_K_M)):  # fmt: skip
        reader = gguf_py.GGUFReader(made.gguf(quant))
        assert reader.fields["general.file_type"].contents() == file_type, quant
    q4_0 = gguf_py.GGUFReader(made.gguf("Q4_0"))
    assert gguf_py.GGMLQuantizationType.Q4_0 in {t.tensor_type for t in q4_0.tensors}
    model = load_model(str(made.gguf("Q4_K_M")), dtype="float32", device="cpu")
    assert (model.config.hidden_size, model.config.num_layers) == (64, 2)
    assert any("llama-quantize" in line for line in said)

    stamp = made.gguf("Q4_0").stat().st_mtime_ns
    again = model_maker.make_shape(TINY_LLAMA, cache, default_gguf_path, said.append)
    assert again.gguf("Q4_0").stat().st_mtime_ns == stamp  # reused, not made again
    assert [m.name for m in model_maker.made_shapes(cache)] == ["tiny-llama"]
    assert model_maker.made_shapes(cache)[0].size > 0

    removed = model_maker.remove_shape(cache, "tiny-llama")
    assert removed.size > 0 and not made.folder.exists()
    with pytest.raises(UsageError, match="made: none"):
        model_maker.remove_shape(cache, "tiny-llama")


def tiny_version(shape: ModelShape) -> ModelShape:
    """`shape` with two layers of the tests' width: its model type, vocabulary, rotary
    settings and special tokens as the real shape has them, which is what the converter
    reads to choose the file's architecture and tokenizer."""
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    if "head_dim" in shape.config:
        small["head_dim"] = 16
    if "moe_intermediate_size" in shape.config:  # the expert count and top k stay real
        small["moe_intermediate_size"] = 32
    return dataclasses.replace(shape, name=f"tiny-{shape.name}", config={**shape.config, **small})


@pytest.mark.parametrize(
    "name", ["llama-3.2-1b", "qwen2.5-1.5b", "gemma-3-270m", "gemma-3-1b", "qwen3-30b-a3b-2l"]
)
def test_every_real_shape_converts_with_the_default_models_tokenizer(
    name, default_gguf_path, tmp_path
):
    """The maker's weights and tokenizer, through llama.cpp's converter, for each real shape:
    every file carries the default model's vocabulary and pre-tokenizer, filled to the
    shape's vocabulary size, and embeddings of that many rows (a Gemma's are cut to the
    tokenizer's length by the converter: unfilled, llama.cpp refuses the file). A qwen2 folder is
    the one transformers would read with Qwen's own tokenizer class (Qwen's pre-tokenizer
    over SmolLM2's vocabulary), a pre-tokenizer the converter does not know and refuses."""
    from kvchat.bench import llama_cpp_tools
    from kvchat.model.gguf.file import GGUFFile
    from kvchat.model.loader import load_model

    shape = tiny_version(SHAPES[name])
    folder = tmp_path / "hf"
    model_maker.write_random_weights(shape, folder, default_gguf_path, memory_cap=8 * 2**30)
    try:
        gguf = llama_cpp_tools.convert(folder, tmp_path / f"{name}.gguf", "bf16", TEST_CACHE)
    except llama_cpp_tools.ConverterUnavailable as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched: {exc}")
    made = GGUFFile.open(gguf).metadata
    default = GGUFFile.open(default_gguf_path).metadata
    assert made["tokenizer.ggml.pre"] == default["tokenizer.ggml.pre"] == "smollm"
    assert len(made["tokenizer.ggml.tokens"]) == shape.config["vocab_size"]
    assert GGUFFile.open(gguf).tensors["token_embd.weight"].shape[0] == shape.config["vocab_size"]
    model = load_model(str(gguf), dtype="float32", device="cpu")
    assert model.config.model_type == shape.transformers_config().model_type
    assert (model.config.hidden_size, model.config.num_layers) == (64, 2)


def test_the_moe_shape_keeps_its_experts_4_bit_and_transformers_reads_kvchats_folder(
    default_gguf_path, quantizer_server
):
    """The Qwen3-MoE shape, made small as the real one is made: kvchat keeps the Q4_0
    file's experts 4-bit, a layer per expert, and the transformers peer, whose own GGUF
    loader would build experts of its default width routed without renormalizing, reads
    the folder kvchat converted the file to: the experts' width and routing of the file,
    and in float32 kvchat's logits (the same weights, dequantized once)."""
    import torch

    from kvchat.bench.peers.hf_model import HfModel
    from kvchat.model.loader import load_model
    from tests.parity_helpers import kvchat_logits, rel_err

    shape = tiny_version(SHAPES["qwen3-30b-a3b-2l"])
    made = model_maker.make_shape(
        shape,
        app_paths().cache_dir,
        default_gguf_path,
        lambda _: None,
        llama_server=str(quantizer_server),
        tools_cache=TEST_CACHE,
    )
    model = load_model(str(made.gguf("Q4_0")), dtype="float32", device="cpu")
    experts = model.transformer.layers[0].experts
    assert len(experts.linears) == 128 and experts.gate_up is None
    assert {type(linear).__name__ for pair in experts.linears for linear in pair} == {"Q4Linear"}
    hf = HfModel(model)
    config = hf.model.config
    assert (config.moe_intermediate_size, config.num_experts_per_tok) == (32, 8)
    assert config.norm_topk_prob
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = hf.model(ids[None]).logits[0]
    assert rel_err(kvchat_logits(model, ids.tolist(), paged=True), theirs) < 1e-5
    # the file's tokenizer as it is (Qwen2Tokenizer's own pre-tokenizer splits these spaces)
    chat = [{"role": "user", "content": "Count  2024  apples."}]
    assert hf.encode_chat(chat) == model.renderer.prompt_ids(chat)
    hf.close()


def test_a_failed_make_leaves_nothing_behind(monkeypatch, tmp_path, default_gguf_path):
    """The random weights are GBs at the real shapes: a converter that fails (or a user's
    Ctrl-C) must not leave them in the cache."""
    from kvchat.bench import llama_cpp_tools

    def converter_fails(*args, **kwargs):
        raise KvchatError("llama.cpp's convert_hf_to_gguf.py failed: (its output)")

    monkeypatch.setattr(llama_cpp_tools, "convert", converter_fails)
    monkeypatch.setattr(llama_cpp_tools, "find_quantize", lambda *_: tmp_path / "llama-quantize")
    cache = tmp_path / "cache"
    with pytest.raises(KvchatError, match="convert_hf_to_gguf"):
        model_maker.make_shape(TINY_LLAMA, cache, default_gguf_path, lambda _: None)
    assert list(model_maker.shapes_dir(cache).iterdir()) == []


def test_a_shape_is_refused_when_the_disk_is_short(monkeypatch, tmp_path):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(model_maker.shutil, "disk_usage", lambda _: usage._replace(free=2 * 10**9))
    with pytest.raises(KvchatError, match=r"needs 14.0GiB of free disk .* there is 1.9GiB"):
        model_maker.check_room(SHAPES["llama-3.2-1b"], 2_500_000_000, tmp_path)


def test_the_real_shapes_count_their_weights_as_the_models_do():
    """Llama 3.2 1B has 1.24 billion weights, Qwen2.5 1.5B 1.54 billion, Gemma 3 1B 1.0
    billion: the configs are the models' own. Qwen3-30B-A3B's embeddings and head (0.62
    billion) and 2 of its 48 layers (0.62 billion each) make 1.87 billion."""
    counts = {name: model_maker.parameter_count(SHAPES[name]) for name in SHAPES}
    assert round(counts["llama-3.2-1b"] / 1e9, 2) == 1.24
    assert round(counts["qwen2.5-1.5b"] / 1e9, 2) == 1.54
    assert round(counts["gemma-3-270m"] / 1e6) == 268  # Google names it 270M
    assert round(counts["gemma-3-1b"] / 1e9, 1) == 1.0
    assert round(counts["qwen3-30b-a3b-2l"] / 1e9, 2) == 1.87


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("llama-7b", "knows llama-3.2-1b, qwen2.5-1.5b, gemma-3-270m, gemma-3-1b"),
        ("llama-3.2-1b:Q8_0", "Q4_0, Q4_K_M after the colon"),
    ],
)
def test_a_shape_not_known_is_refused_with_the_known_ones(spec, says):
    with pytest.raises(UsageError, match=says):
        model_maker.parse_shape(spec)


def test_the_bench_lists_and_removes_shapes_from_the_command_line(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "KVCHAT_HOME": str(tmp_path / "home")}
    listed = subprocess.run(
        [sys.executable, "-m", "kvchat", "bench", "--list-shapes"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0 and "No shapes made yet" in listed.stdout
    removed = subprocess.run(
        [sys.executable, "-m", "kvchat", "bench", "--remove-shape", "gemma-3-1b"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert removed.returncode == 2 and "No shape 'gemma-3-1b' has been made" in removed.stderr
