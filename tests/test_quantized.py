"""GGUF 4-bit weights kept 4-bit: the int4 path computes what the dequantized path computes."""

from __future__ import annotations

import pytest
import torch

from kvchat.model.linear import StackedLinear
from kvchat.model.loader import load_model
from kvchat.model.quantized_linear import (
    Int4Linear,
    Int8Linear,
    Q4Linear,
    Q8Linear,
    quantize_int4_rtn,
)
from tests.parity_helpers import kvchat_logits, rel_err
from tests.tiny_gguf import write_tiny_gguf


def ids_for(model, n: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_path_matches_the_dequantized_path(tmp_path, qtype, native_kernels):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    native = load_model(str(path), dtype="float32", device="cpu")
    dense = load_model(str(path), dtype="float32", device="cpu", weights="bf16")
    # in float32 the 4-bit layers go to kvchat's kernel, which computes the GGUF's exact
    # weights: within fp32 tolerance of the dequantized model in decode-sized chunks
    assert isinstance(native.transformer.layers[0].qkv, Q4Linear)
    # and they stay 4-bit in memory: the kernel takes prefill batches too
    assert all(
        linear.dense is None
        for linear in native.transformer._linears()
        if isinstance(linear, Q4Linear)
    )
    assert native.fingerprint != dense.fingerprint  # their KV pages must never be shared
    ids = ids_for(native)
    exact = kvchat_logits(dense, ids, paged=True)
    assert rel_err(kvchat_logits(native, ids, paged=True), exact) < 1e-4
    assert not isinstance(native.transformer.lm_head, Int8Linear)
    # in bf16 the int4 path is as close to the exact logits as dequantized bf16 is
    native16 = load_model(str(path), dtype="bfloat16", device="cpu")
    dense16 = load_model(str(path), dtype="bfloat16", device="cpu", weights="bf16")
    theirs = rel_err(kvchat_logits(dense16, ids, paged=True), exact)
    assert rel_err(kvchat_logits(native16, ids, paged=True), exact) <= 1.5 * theirs + 2e-2
    # bf16 decodes through kvchat's kernel too (the file's exact weights, activations
    # widened), prefill batches through the dense copy
    assert isinstance(native16.transformer.layers[0].qkv, Q4Linear)
    assert native16.transformer.layers[0].qkv.packed_from_rows() is not None
    assert rel_err(logits_in_small_chunks(native16, ids), exact) <= 1.5 * theirs + 2e-2


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])  # a Q8_0 and a Q6_K token_embd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_eight_bit_head_serves_the_embedding_rows(tmp_path, qtype, dtype, native_kernels):
    """The tied head's codes are the embedding table: every row the file's exact weights,
    equal bit for bit to the dense table kvchat converted the file to (which stays
    unread), and the logits the same as through that table."""
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype)
    model = load_model(str(path), dtype=str(dtype).removeprefix("torch."), device="cpu")
    t = model.transformer
    assert t.embed_codes is t.lm_head and isinstance(t.lm_head, Q8Linear)
    every = torch.arange(model.config.vocab_size)
    assert torch.equal(t.embed_codes.rows(every).to(dtype), t.embed)
    ids = ids_for(model, 20)
    through_codes = kvchat_logits(model, ids, paged=True)
    t.embed_codes = None
    assert torch.equal(kvchat_logits(model, ids, paged=True), through_codes)


def test_a_q4_k_m_files_six_bit_matrices_stay_eight_bit_and_exact(tmp_path, native_kernels):
    """llama-quantize's Q4_K_M keeps attn_v, ffn_down and the head in Q6_K: those become
    8-bit codes with the file's scale per 16 (not a dense copy), q/k/v a stack of a 4-bit
    q/k and the 8-bit v, and the model computes the file's exact weights in float32; the
    prepared-weights cache brings the same layers back."""
    path = write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M")
    native = load_model(str(path), dtype="float32", device="cpu")
    dense = load_model(str(path), dtype="float32", device="cpu", weights="bf16")
    layer = native.transformer.layers[0]
    assert isinstance(layer.qkv, StackedLinear)
    assert [type(part) for part in layer.qkv.parts] == [Q4Linear, Q8Linear]
    v = layer.qkv.parts[1]
    assert v.scales.shape[1] == v.in_features // 16  # Q6_K's sub-blocks
    # float32 expands the K-quants' sub-scales once, at load (its loop is bound by
    # instructions); bf16 keeps the file's 8-bit sub-scales and float16s per 256 columns
    assert v.scales.dtype == torch.float32 and v.scale_supers is None
    assert isinstance(layer.down, Q8Linear) and isinstance(layer.gate_up, Q4Linear)
    assert isinstance(native.transformer.lm_head, Q8Linear)
    ids = ids_for(native)
    exact = kvchat_logits(dense, ids, paged=True)
    assert rel_err(kvchat_logits(native, ids, paged=True), exact) < 1e-4
    assert rel_err(logits_in_small_chunks(native, ids), exact) < 1e-4  # the decode paths
    native16 = load_model(str(path), dtype="bfloat16", device="cpu")
    v16, qk16 = (
        native16.transformer.layers[0].qkv.parts[1],
        native16.transformer.layers[0].qkv.parts[0],
    )
    assert [type(p) for p in (qk16, v16)] == [Q4Linear, Q8Linear]
    assert v16.scales.dtype == torch.int8 and v16.scale_supers is not None
    assert qk16.scales.dtype == torch.uint8 and qk16.offset_supers is not None
    dense16 = load_model(str(path), dtype="bfloat16", device="cpu", weights="bf16")
    theirs = rel_err(logits_in_small_chunks(dense16, ids), exact)
    ours = logits_in_small_chunks(native16, ids)
    assert rel_err(ours, exact) <= 1.5 * theirs + 2e-2
    again = load_model(str(path), dtype="bfloat16", device="cpu")  # the prepared cache
    assert [type(p) for p in again.transformer.layers[0].qkv.parts] == [Q4Linear, Q8Linear]
    assert torch.equal(logits_in_small_chunks(again, ids), ours)


def test_int4_linear_multiplies_by_its_dequantized_weight():
    w = torch.randn(48, 96)
    codes, scales, offsets = quantize_int4_rtn(w)
    linear = Int4Linear(codes, scales, offsets, torch.float32)
    x = torch.randn(3, 96)
    expected = x @ linear.dequantized().t()
    assert torch.allclose(linear(x), expected, rtol=1e-4, atol=1e-4)
    rebuilt = (codes.float().reshape(48, 3, 32) * scales[..., None] + offsets[..., None]).reshape(
        48, 96
    )
    assert torch.allclose(linear.dequantized(), rebuilt, atol=1e-5)
    assert (rebuilt - w).abs().max() <= scales.max() / 2 + 1e-6  # round to nearest


def test_int8_linear_is_close_to_the_dense_product():
    w = torch.randn(64, 32)
    x = torch.randn(2, 32)
    assert rel_err(Int8Linear(w, torch.float32)(x), x @ w.t()) < 1e-2


def test_quantize_option_for_hugging_face_folders(tmp_path):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    dense = load_model(str(folder), dtype="float32", device="cpu")
    ids = ids_for(dense)
    exact = kvchat_logits(dense, ids, paged=True)
    # round-to-nearest int4 of random 64-wide weights costs about 0.2 of the logits'
    # norm at every row count (its kernels' exactness is tested in test_quantized_matmul)
    for mode, bound in (("int8", 2e-2), ("int4", 3e-1)):
        q = load_model(str(folder), dtype="float32", device="cpu", quantize=mode)
        assert q.fingerprint.endswith(mode)
        assert rel_err(kvchat_logits(q, ids, paged=True), exact) < bound


def test_prepared_weights_cache_reloads_the_same_layers(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1")
    first = load_model(str(path), dtype="bfloat16", device="cpu")
    again = load_model(str(path), dtype="bfloat16", device="cpu")  # from the prepared cache
    ids = ids_for(first, 80)
    # 80-token chunks run the dense/int8 paths at M >= 32, where unaligned weights crashed
    batch_logits = [kvchat_logits(m, ids, paged=True) for m in (first, again)]
    assert torch.equal(batch_logits[0], batch_logits[1])


def test_quantized_folder_is_cached_for_the_next_start(tmp_path, kvchat_home):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", hidden_size=64, intermediate_size=128)
    first = load_model(str(folder), dtype="float32", device="cpu", quantize="int4")
    # the model cache is the run's shared one (other tests quantize other folders there)
    quantized = kvchat_home / "cache" / "models" / "quantized"
    assert (quantized / f"{first.fingerprint}-float32.safetensors").is_file()
    again = load_model(str(folder), dtype="float32", device="cpu", quantize="int4")
    ids = ids_for(first)
    assert torch.equal(kvchat_logits(first, ids, paged=True), kvchat_logits(again, ids, paged=True))


def logits_in_small_chunks(model, ids: list[int], chunk: int = 8) -> torch.Tensor:
    """Every position's logits, fed 8 tokens a step: decode-sized batches, which take the
    int4 kernel users decode with (from `PACKED_FROM_TOKENS` rows on, layers switch to
    their dense copy, which would measure the dequantized weights instead)."""
    from kvchat.engine.attention.paged_attention import PagedAttention
    from kvchat.engine.tiers.kv_store import DeviceKVStore
    from kvchat.model.batch import ForwardBatch

    c = model.config
    pages = len(ids) // 64 + 2
    store = DeviceKVStore(
        c.num_layers, pages, 64, c.num_kv_heads, c.head_dim, model.transformer.dtype, "cpu"
    )
    attention = PagedAttention.for_store(store)
    out = []
    for start in range(0, len(ids), chunk):
        batch = ForwardBatch.from_runs([ids[start : start + chunk]], [start], all_logits=True)
        attention.prepare(batch, [list(range(pages))])
        out.append(model.transformer.forward(batch, attention))
    return torch.cat(out)


AGREEMENT_PROMPTS = [
    "Explain why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "What are the three states of matter?",
    "Give me a short tip for learning Python.",
    "Describe a cat in two sentences.",
]


@pytest.mark.real_model
@pytest.mark.slow
def test_default_model_int4_path_agrees_with_dequantized_bf16(default_gguf_path, capsys):
    """The 4-bit path should agree with the dense one on >= 60 of 64 greedy tokens on 5 prompts.
    Free-running generations cannot be held to that: bf16 noise alone makes them diverge
    early (measured: dense fp32 vs dense bf16 agreed on [39, 10, 64, 42, 31] of 64; int4 vs
    dense bf16 on [22, 15, 63, 42, 32]). So this asserts it step by step: along the
    dequantized path's own 64 greedy tokens, the int4 path picks the same next token (see
    the assertion for the bound), and prints the free-running agreement for the record."""
    from tests.engine_helpers import generate

    native = load_model(str(default_gguf_path), dtype="bfloat16", device="cpu")
    dense = load_model(str(default_gguf_path), dtype="bfloat16", device="cpu", weights="bf16")
    stepwise, free_running = [], []
    for text in AGREEMENT_PROMPTS:
        ids = native.renderer.prompt_ids([{"role": "user", "content": text}])
        reference = generate(dense, ids, max_tokens=64, ignore_eos=True)
        free_running.append(
            sum(
                a == b
                for a, b in zip(
                    generate(native, ids, max_tokens=64, ignore_eos=True), reference, strict=True
                )
            )
        )
        sequence = ids + reference[:-1]  # each position predicts the next reference token
        logits = logits_in_small_chunks(native, sequence)  # the 4-bit decode path throughout
        chosen = logits[len(ids) - 1 :].argmax(-1).tolist()
        stepwise.append(sum(a == b for a, b in zip(chosen, reference, strict=True)))
    with capsys.disabled():
        print(f"\nint4 vs dequantized bf16 (of 64): step by step {stepwise}")
        print(f"free-running {free_running}")
    # measured step by step, 8 rows a step (the int4 kernel): [62, 63, 63, 63, 61]; with
    # 16 rows a step (the dense copy, before PACKED_FROM_TOKENS) it was [59, 62, 62, 62, 63].
    # Asserted: >= 60 on average, >= 56 on each.
    assert sum(stepwise) >= 60 * len(stepwise) and min(stepwise) >= 56, stepwise


def test_an_older_versions_prepared_layers_are_removed(tmp_path):
    """Each kvchat version that changes the prepared layers writes a new file (a GB or
    more for a 1B model); the ones an older version wrote are deleted, not kept forever."""
    path = write_tiny_gguf(tmp_path / "tiny-stale.gguf", "Q4_0", seed=11)
    first = load_model(str(path), dtype="bfloat16", device="cpu")
    (current,) = first.folder.glob("native-q4-v*-bfloat16.safetensors")
    stale = first.folder / "native-q4-v1-bfloat16.safetensors"
    stale.write_bytes(b"an older format")
    other_dtype = first.folder / "native-q4-v1-float32.safetensors"
    other_dtype.write_bytes(b"an older format")
    current.unlink()  # as when the version changes: the layers are prepared again
    load_model(str(path), dtype="bfloat16", device="cpu")
    assert current.is_file() and not stale.exists()
    assert other_dtype.exists()  # float32's are cleaned when float32 prepares its own


def test_a_full_disk_while_converting_is_a_clear_error(tmp_path, monkeypatch):
    """safetensors reports a full disk as its own error, not OSError: the user gets what
    to do, and no half-written file is left."""
    from safetensors import SafetensorError

    from kvchat.errors import ModelLoadError
    from kvchat.model import loader

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(loader, "save_file", disk_full)
    path = write_tiny_gguf(tmp_path / "tiny-full.gguf", "Q4_0", seed=12)
    with pytest.raises(ModelLoadError, match="Is the disk full") as caught:
        load_model(str(path), dtype="bfloat16", device="cpu")
    assert "GiB free" in str(caught.value)
    folder = next(
        p
        for p in loader.app_paths().models_dir.glob("converted/*")
        if p.is_dir() and (p / "source.json").read_text().find("tiny-full") >= 0
    )
    assert not list(folder.glob("*.partial"))
