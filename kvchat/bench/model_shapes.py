"""Model shapes the bench measures beside the default model: the real configurations of
models people run, filled with seeded random weights (`model_maker`).

Speed does not depend on the weights' values, so random weights of a real shape measure
it honestly; the answers are exact-length (`ignore_eos`), as random weights say nothing
worth reading. Each shape is the model's own config.json values, as transformers builds
it (`transformers_class`), so llama.cpp's converter and kvchat read the files they would
read from the real model. One shape is cut: `qwen3-30b-a3b-2l` is Qwen3-30B-A3B's
config with 2 of its 48 layers (1.87 billion weights, 3.5 GiB in bf16), so that kvchat,
transformers and the files they read fit one machine beside each other while every
layer, router and expert has the real model's size; a decode step of it does what two
of the real model's 48 layers do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    name: str
    describes: str  # the model whose configuration this is
    config_class: str  # transformers' config class
    config: dict[str, Any] = field(default_factory=dict)
    # more of llama.cpp's converter flags this shape needs (`--no-mtp`: its folder has no
    # multi-token-prediction layers, which the converter otherwise asks of Qwen3.5's)
    convert_options: tuple[str, ...] = ()

    def transformers_config(self):
        import transformers

        return getattr(transformers, self.config_class)(**self.config)


LLAMA_3_2_1B = ModelShape(
    "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B-Instruct",
    "LlamaConfig",
    {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    },
)

QWEN2_5_1_5B = ModelShape(
    "qwen2.5-1.5b",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen2Config",
    {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
)

# what Gemma 3's text models share (its 262,144-token vocabulary, four query heads and
# one kv head of 256, windows of 512 in five layers of six)
_GEMMA_3 = {
    "vocab_size": 262144,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "bos_token_id": 2,
    "eos_token_id": 106,
}

GEMMA_3_270M = ModelShape(
    "gemma-3-270m",
    "google/gemma-3-270m-it",
    "Gemma3TextConfig",
    {**_GEMMA_3, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18},
)

GEMMA_3_1B = ModelShape(
    "gemma-3-1b",
    "google/gemma-3-1b-it",
    "Gemma3TextConfig",
    {**_GEMMA_3, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26},
)

# Qwen3-30B-A3B's 48 layers cut to 2: the bf16 weights, which transformers holds and the
# maker writes, go from 61 GB to 3.7 GB (the embeddings and the untied head are a third)
QWEN3_30B_A3B_2L = ModelShape(
    "qwen3-30b-a3b-2l",
    "Qwen/Qwen3-30B-A3B with 2 of its 48 layers",
    "Qwen3MoeConfig",
    {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
)

# Qwen3.5's hybrid layers as transformers' Qwen3_5TextConfig defaults them ("Qwen3.5-9B
# style": 16 + 32 linear-attention heads of 128 beside 16 + 4 attention heads of 256),
# 4 of its 32 layers (three linear, one full): the switch workloads measure how much of a
# conversation its kept states spare; the embeddings and untied head are two thirds of it
QWEN3_5_9B_4L = ModelShape(
    "qwen3.5-9b-4l",
    "transformers' Qwen3.5-9B-style Qwen3_5TextConfig with 4 of its 32 layers",
    "Qwen3_5TextConfig",
    {
        "vocab_size": 248320,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
    },
    convert_options=("--no-mtp",),
)

# a few hundred thousand weights, for the tests of the maker itself
TINY_LLAMA = ModelShape(
    "tiny-llama",
    "a Llama of the tests' size",
    "LlamaConfig",
    {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
)

SHAPES = {
    shape.name: shape
    for shape in (
        LLAMA_3_2_1B,
        QWEN2_5_1_5B,
        GEMMA_3_270M,
        GEMMA_3_1B,
        QWEN3_30B_A3B_2L,
        QWEN3_5_9B_4L,
        TINY_LLAMA,
    )
}
QUANTS = ("Q4_0", "Q4_K_M")  # what each shape is made in, by llama-quantize
