"""A tiny random llama model written as a real GGUF file, in a chosen 4-bit type.

Shapes satisfy torch's int4 kernel (N a multiple of 16, K of 32) so the native
4-bit path runs; the vocabulary is GPT-2's byte alphabet, so the tokenizer
rebuilt from the metadata works too.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_HEADS, N_KV_HEADS, LAYERS = 4, 2, 2


def _byte_alphabet() -> list[str]:
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _random_k_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    nbytes = gguf.GGML_QUANT_SIZES[qtype][1]
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for off in (0, 2):  # d and dmin as small positive halves
        blocks[:, off : off + 2] = (
            rng.uniform(0.001, 0.02, size=(n, 1)).astype(np.float16).view(np.uint8)
        )
    return blocks.reshape(rows, -1)


def _random_q6_k_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Q6_K blocks: random 6-bit codes, signed sub-scales, a small f16 d at the end."""
    n = rows * cols // 256
    codes = rng.integers(0, 256, size=(n, 192), dtype=np.uint8)
    sub = rng.integers(-64, 65, size=(n, 16), dtype=np.int8).view(np.uint8)
    d = rng.uniform(0.0002, 0.001, size=(n, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([codes, sub, d], axis=1).reshape(rows, -1)


# llama-quantize's Q4_K_M keeps these in Q6_K (some layers' only; here every layer's)
Q4_K_M_SIX_BIT = ("attn_v", "ffn_down", "token_embd")


def write_tiny_gguf(path: Path, qtype: str = "Q4_1", seed: int = 0) -> Path:
    """A tiny Llama GGUF of random weights in `qtype`, or "Q4_K_M": Q4_K matrices with
    `Q4_K_M_SIX_BIT` in Q6_K, as llama-quantize mixes them."""
    rng = np.random.default_rng(seed)
    mixed = qtype == "Q4_K_M"
    qtype = "Q4_K" if mixed else qtype
    kind = gguf.GGMLQuantizationType[qtype]
    # K-quants pack 256 columns a block: rows must be at least that wide
    HIDDEN = FFN = 256 if qtype.endswith("_K") else 64
    if not qtype.endswith("_K"):
        FFN = 128
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "ab"]
    vocab = len(tokens) + (-len(tokens)) % 32  # pad so the head's N is a multiple of 16
    tokens += [f"<|unused{i}|>" for i in range(vocab - len(tokens))]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", LAYERS)
    writer.add_uint32("llama.context_length", 512)
    writer.add_uint32("llama.embedding_length", HIDDEN)
    writer.add_uint32("llama.feed_forward_length", FFN)
    writer.add_uint32("llama.attention.head_count", N_HEADS)
    writer.add_uint32("llama.attention.head_count_kv", N_KV_HEADS)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)

    def add(name: str, rows: int, cols: int) -> None:
        if mixed and name.split(".")[-2] in Q4_K_M_SIX_BIT:
            six = gguf.GGMLQuantizationType.Q6_K
            writer.add_tensor(name, _random_q6_k_blocks(rows, cols, rng), raw_dtype=six)
        elif kind in (gguf.GGMLQuantizationType.Q4_K,):
            writer.add_tensor(name, _random_k_blocks(kind, rows, cols, rng), raw_dtype=kind)
        else:
            w = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    emb = (rng.standard_normal((vocab, HIDDEN)) * 0.5).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    if mixed:
        add("token_embd.weight", vocab, HIDDEN)
    else:
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(emb, q8), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    head_dim = HIDDEN // N_HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_q.weight", N_HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_k.weight", N_KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_v.weight", N_KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
