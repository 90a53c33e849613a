"""Model shapes the bench measures beside the default model: the real configurations of
models people run, filled with seeded random weights (`model_maker`).

Speed does not depend on the weights' values, so random weights of a real shape measure
it honestly; the answers are exact-length (`ignore_eos`), as random weights say nothing
worth reading. Each shape is the model's own config.json values, as transformers builds
it (`transformers_class`), so llama.cpp's converter and kvchat read the files they would
read from the real model.
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

GEMMA_3_1B = ModelShape(
    "gemma-3-1b",
    "google/gemma-3-1b-it",
    "Gemma3TextConfig",
    {
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "max_position_embeddings": 32768,
        "sliding_window": 512,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 106,
    },
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

SHAPES = {shape.name: shape for shape in (LLAMA_3_2_1B, QWEN2_5_1_5B, GEMMA_3_1B, TINY_LLAMA)}
QUANTS = ("Q4_0", "Q4_K_M")  # what each shape is made in, by llama-quantize
