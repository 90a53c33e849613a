"""Reading GGUF files, and converting a llama-family GGUF to Hugging Face config and names.

Files are written with the `gguf` package's writer (a test-only dependency),
so what we read back is checked against an independent implementation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvchat.errors import ModelLoadError  # noqa: E402
from kvchat.model.config import ModelConfig  # noqa: E402
from kvchat.model.gguf.convert import (  # noqa: E402
    gguf_state_dict,
    gguf_to_hf_config,
    llama_cpp_permute,
    undo_llama_cpp_permute,
)
from kvchat.model.gguf.file import GGMLType, GGUFFile  # noqa: E402


@pytest.fixture
def gguf_path(default_gguf_path: Path) -> Path:
    """The default model's GGUF (conftest fetches it once)."""
    return default_gguf_path


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict, alignment: int | None = None):
    """Write a GGUF; `tensors` maps name -> float32 array or (raw bytes, GGMLQuantizationType)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in metadata.items():
        getattr(writer, f"add_{kind}")(key, value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def small_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((4, 8)).astype(np.float16)
    q8_source = rng.standard_normal((2, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(q8_source, gguf.GGMLQuantizationType.Q8_0)
    metadata = {
        "test.u8": ("uint8", 200),
        "test.i32": ("int32", -7),
        "test.u64": ("uint64", 2**40 + 3),
        "test.f32": ("float32", 0.25),
        "test.f64": ("float64", 1e-300),
        "test.flag": ("bool", True),
        "test.name": ("string", "héllo ✓"),
        "test.ints": ("array", [1, 2, 3]),
        "test.words": ("array", ["a", "", "ü"]),
    }
    tensors = {"a.f32": f32, "b.f16": f16, "c.q8": (q8, gguf.GGMLQuantizationType.Q8_0)}
    path = write_gguf(tmp_path / "small.gguf", "llama", metadata, tensors, alignment=64)
    return path, {"a.f32": f32, "b.f16": f16, "c.q8": q8}


def test_metadata_of_every_type_reads_back(small_gguf) -> None:
    path, _ = small_gguf
    md = GGUFFile.open(path).metadata

    assert md["general.architecture"] == "llama"
    assert md["test.u8"] == 200
    assert md["test.i32"] == -7
    assert md["test.u64"] == 2**40 + 3
    assert md["test.f32"] == 0.25
    assert md["test.f64"] == 1e-300
    assert md["test.flag"] is True
    assert md["test.name"] == "héllo ✓"
    assert md["test.ints"] == [1, 2, 3]
    assert md["test.words"] == ["a", "", "ü"]
    assert md["general.alignment"] == 64


def test_tensor_table_and_bytes_match_the_gguf_reader(small_gguf) -> None:
    path, written = small_gguf
    ours = GGUFFile.open(path)
    reference = gguf.GGUFReader(str(path))

    assert set(ours.tensors) == set(written)
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == GGMLType(int(tensor.tensor_type))
        assert info.shape == tuple(reversed(tensor.shape.tolist()))  # torch order
        assert info.n_bytes == tensor.n_bytes
        assert info.offset % 64 == 0
        np.testing.assert_array_equal(ours.raw(tensor.name), tensor.data.view(np.uint8).reshape(-1))
    assert ours.tensors["b.f16"].shape == (4, 8)
    assert ours.tensors["c.q8"].shape == (2, 64)
    np.testing.assert_array_equal(
        ours.raw("a.f32").view(np.float32).reshape(3, 5), written["a.f32"]
    )


def test_raw_is_a_view_of_the_mapping_not_a_copy(small_gguf) -> None:
    path, _ = small_gguf
    raw = GGUFFile.open(path).raw("a.f32")
    assert not raw.flags.owndata
    assert not raw.flags.writeable


def test_truncated_tensor_data_is_reported_as_truncated(small_gguf) -> None:
    path, _ = small_gguf
    last = GGUFFile.open(path).tensors["c.q8"]
    path.write_bytes(path.read_bytes()[: last.offset + last.n_bytes - 1])
    with pytest.raises(ModelLoadError, match=r"truncated.*c\.q8.*Download the model again"):
        GGUFFile.open(path)


def test_file_cut_inside_the_metadata_is_reported_as_truncated(small_gguf) -> None:
    path, _ = small_gguf
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile.open(path)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 this is a zip file, not a model"])
def test_non_gguf_file_is_a_model_load_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile.open(path)


def test_missing_file_is_a_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read"):
        GGUFFile.open(tmp_path / "absent.gguf")


def test_unsupported_version_says_which_versions_are_read(small_gguf) -> None:
    path, _ = small_gguf
    data = bytearray(path.read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"version 1; kvchat reads versions 2, 3"):
        GGUFFile.open(path)


# ---- conversion to Hugging Face config and tensor names -------------------------------------

N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN, FFN, VOCAB = 4, 2, 8, 32, 64, 48


def numpy_llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def tiny_model(tmp_path: Path, arch: str, *, tied: bool, biases: bool = False):
    """A two-layer model written as llama.cpp would: HF weights, q/k permuted for llama."""
    rng = np.random.default_rng(1)
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN))}
    tensors: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"]}
    if not tied:
        hf["lm_head.weight"] = tensors["output.weight"] = rng.standard_normal((VOCAB, HIDDEN))
    hf["model.norm.weight"] = tensors["output_norm.weight"] = rng.standard_normal(HIDDEN)
    shapes = {
        "attn_q": ("self_attn.q_proj", N_HEADS * HEAD_DIM, HIDDEN),
        "attn_k": ("self_attn.k_proj", N_KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": ("self_attn.v_proj", N_KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": ("self_attn.o_proj", HIDDEN, N_HEADS * HEAD_DIM),
        "ffn_gate": ("mlp.gate_proj", FFN, HIDDEN),
        "ffn_up": ("mlp.up_proj", FFN, HIDDEN),
        "ffn_down": ("mlp.down_proj", HIDDEN, FFN),
    }
    for layer in range(2):
        for gguf_name, (hf_name, rows, cols) in shapes.items():
            w = rng.standard_normal((rows, cols))
            hf[f"model.layers.{layer}.{hf_name}.weight"] = w
            if arch == "llama" and gguf_name == "attn_q":
                w = numpy_llama_cpp_permute(w, N_HEADS, N_HEADS)
            elif arch == "llama" and gguf_name == "attn_k":
                w = numpy_llama_cpp_permute(w, N_HEADS, N_KV_HEADS)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = w
            if biases and gguf_name in ("attn_q", "attn_k", "attn_v"):
                b = rng.standard_normal(rows)
                hf[f"model.layers.{layer}.{hf_name}.bias"] = b
                tensors[f"blk.{layer}.{gguf_name}.bias"] = b
        norms = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]
        for gguf_name, hf_name in norms:
            w = rng.standard_normal(HIDDEN)
            hf[f"model.layers.{layer}.{hf_name}.weight"] = tensors[
                f"blk.{layer}.{gguf_name}.weight"
            ] = w
        if arch == "qwen3":  # one weight of head_dim for every head of q, one for k
            for gguf_name, hf_name in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                w = rng.standard_normal(HEAD_DIM)
                hf[f"model.layers.{layer}.self_attn.{hf_name}.weight"] = w
                tensors[f"blk.{layer}.{gguf_name}.weight"] = w
    metadata = {
        f"{arch}.block_count": ("uint32", 2),
        f"{arch}.context_length": ("uint32", 256),
        f"{arch}.embedding_length": ("uint32", HIDDEN),
        f"{arch}.feed_forward_length": ("uint32", FFN),
        f"{arch}.attention.head_count": ("uint32", N_HEADS),
        f"{arch}.attention.head_count_kv": ("uint32", N_KV_HEADS),
        f"{arch}.rope.freq_base": ("float32", 100000.0),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
    }
    if arch == "qwen3":  # its head_dim is its own (not hidden / heads): the file says it
        metadata[f"{arch}.attention.key_length"] = ("uint32", HEAD_DIM)
        metadata[f"{arch}.attention.value_length"] = ("uint32", HEAD_DIM)
    as_f32 = {k: v.astype(np.float32) for k, v in tensors.items()}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, metadata, as_f32)
    return path, {k: torch.from_numpy(v.astype(np.float32)) for k, v in hf.items()}


def test_undo_permute_is_the_inverse_of_llama_cpp_permute() -> None:
    w = torch.randn(N_KV_HEADS * HEAD_DIM, HIDDEN)
    permuted = numpy_llama_cpp_permute(w.numpy(), N_HEADS, N_KV_HEADS)

    assert torch.equal(llama_cpp_permute(w, N_KV_HEADS), torch.from_numpy(permuted))
    assert torch.equal(undo_llama_cpp_permute(torch.from_numpy(permuted), N_KV_HEADS), w)
    assert not torch.equal(torch.from_numpy(permuted), w)


def test_llama_state_dict_has_hf_names_and_unpermuted_q_k(tmp_path: Path) -> None:
    path, expected = tiny_model(tmp_path, "llama", tied=False)

    got = dict(gguf_state_dict(GGUFFile.open(path), torch.bfloat16))

    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_qwen2_state_dict_keeps_q_k_rows_and_yields_biases(tmp_path: Path) -> None:
    path, expected = tiny_model(tmp_path, "qwen2", tied=True, biases=True)

    got = dict(gguf_state_dict(GGUFFile.open(path), torch.float32))

    assert "model.layers.1.self_attn.k_proj.bias" in got
    assert "lm_head.weight" not in got  # tied: the loader reuses the embeddings
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name


def test_qwen3_state_dict_has_the_q_k_norms_and_its_config_the_head_size(tmp_path: Path) -> None:
    path, expected = tiny_model(tmp_path, "qwen3", tied=True)
    gguf = GGUFFile.open(path)

    got = dict(gguf_state_dict(gguf, torch.float32))

    assert "model.layers.1.self_attn.q_norm.weight" in got
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name  # q/k rows as written: no permutation
    config = gguf_to_hf_config(gguf)
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert config["head_dim"] == HEAD_DIM
    assert ModelConfig.from_dict(config).qk_norm


def test_hf_config_from_llama_metadata(tmp_path: Path) -> None:
    path, _ = tiny_model(tmp_path, "llama", tied=True)

    config = gguf_to_hf_config(GGUFFile.open(path))

    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == HIDDEN
    assert config["intermediate_size"] == FFN
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == N_HEADS
    assert config["num_key_value_heads"] == N_KV_HEADS
    assert config["head_dim"] == HIDDEN // N_HEADS
    assert config["rms_norm_eps"] == 1e-5  # the float32 in the file, as the decimal it came from
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 256
    assert config["vocab_size"] == VOCAB
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in config


def test_untied_model_config_says_so(tmp_path: Path) -> None:
    path, _ = tiny_model(tmp_path, "llama", tied=False)
    assert gguf_to_hf_config(GGUFFile.open(path))["tie_word_embeddings"] is False


def test_rope_scaling_metadata_becomes_hf_rope_scaling(tmp_path: Path) -> None:
    metadata = {
        "llama.block_count": ("uint32", 1),
        "llama.embedding_length": ("uint32", 64),
        "llama.feed_forward_length": ("uint32", 128),
        "llama.attention.head_count": ("uint32", 4),
        "llama.vocab_size": ("uint32", 10),
        "llama.rope.scaling.type": ("string", "linear"),
        "llama.rope.scaling.factor": ("float32", 4.0),
    }
    path = write_gguf(tmp_path / "scaled.gguf", "llama", metadata, {})
    config = gguf_to_hf_config(GGUFFile.open(path))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert config["head_dim"] == 16


def test_unsupported_architecture_names_it_and_the_supported_family(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {}, {})
    gguf_file = GGUFFile.open(path)
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture gpt2; kvchat runs GGUFs of the gemma3 .* qwen3",
    ):
        gguf_to_hf_config(gguf_file)
    with pytest.raises(ModelLoadError, match="unsupported architecture gpt2"):
        next(gguf_state_dict(gguf_file, torch.float32))


@pytest.mark.real_model
def test_default_model_converts_like_transformers(gguf_path: Path) -> None:
    """Config as SmolLM2-135M's config.json; q/k as transformers' GGUF loader un-permutes them."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = GGUFFile.open(gguf_path)
    config = gguf_to_hf_config(model)
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0

    processor = LlamaTensorProcessor(config=config)
    ours = dict(gguf_state_dict(model, torch.float32))
    for gguf_name, hf_name in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
    ):
        info = model.tensors[gguf_name]
        weights = gguf.quants.dequantize(
            np.asarray(model.raw(gguf_name)).reshape(info.shape[0], -1), info.ggml_type
        )
        expected = processor.process(weights, gguf_name).weights
        assert torch.equal(ours[hf_name], torch.from_numpy(np.ascontiguousarray(expected)))


def llama_cpp_rope_factors(theta: float, dim: int, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama 3 `rope_freqs`, with Llama 3.1's low/high factors and 8192."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("scrambled", [False, True])
def test_llama3_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path: Path, scrambled) -> None:
    metadata = {
        "llama.block_count": ("uint32", 1),
        "llama.embedding_length": ("uint32", 128),
        "llama.feed_forward_length": ("uint32", 256),
        "llama.attention.head_count": ("uint32", 2),
        "llama.rope.dimension_count": ("uint32", 64),
        "llama.rope.freq_base": ("float32", 500000.0),
        "llama.vocab_size": ("uint32", 10),
    }
    factors = llama_cpp_rope_factors(500000.0, 64, 32.0)
    if scrambled:
        factors = factors[::-1].copy()
    path = write_gguf(tmp_path / "l3.gguf", "llama", metadata, {"rope_freqs.weight": factors})
    model = GGUFFile.open(path)
    if scrambled:
        with pytest.raises(ModelLoadError, match="rope_freqs"):
            gguf_to_hf_config(model)
        return
    assert gguf_to_hf_config(model)["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert list(gguf_state_dict(model, torch.float32)) == []  # config, not a weight
