"""Tiny random-weight models written as real Hugging Face folders (safetensors + tokenizer).

The mechanics tests run on these: a few layers, a vocabulary of a few hundred
tokens, random weights from a fixed seed. Real text needs the real default model.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)


# Phi-4-mini's rotary, scaled down: 3/4 of each head (12 of 16 dimensions) rotates,
# LongRoPE with an original context of 256 in a context of 2,048 (attention factor
# sqrt(1 + ln 8 / ln 256)); short and long factors far apart so a mix-up shows
PHI3_ORIGINAL_CONTEXT = 256
PHI3_ROPE = dict(
    partial_rotary_factor=0.75,
    original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT,
        "short_factor": [1.0, 1.05, 1.2, 1.6, 2.5, 4.0],
        "long_factor": [1.0, 2.0, 4.0, 9.0, 20.0, 45.0],
    },
)


# Ministral 3's rotary, scaled down: YaRN stretching an original context of 64 sixteen
# times, and queries scaled up every 64 positions (Ministral 3: 16,384, factor 16)
MINISTRAL3_ORIGINAL_CONTEXT = 64
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1_000_000.0,
    "factor": 16.0,
    "original_max_position_embeddings": MINISTRAL3_ORIGINAL_CONTEXT,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}

# gpt-oss's rotary (YaRN, not truncated) and window, scaled down from an original context
# of 4,096 and a window of 128
GPT_OSS_WINDOW = 16
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150_000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}

# Gemma 3's window, scaled down from 512 (1B) and 1,024 (4B and up)
GEMMA3_WINDOW = 16

# Qwen3.5's hybrid pattern, scaled down: every other layer full attention (every fourth
# there), so four layers hold both kinds twice; linear layers with fewer key heads than
# value heads, as Qwen3.5's (16 and 32 there)
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# the hybrids with experts, stacked in transformers' modules (3-d parameters)
STACKED_EXPERTS = ("qwen3_5_moe_text", "qwen3_next")
QWEN35_LAYERS = dict(
    num_hidden_layers=4,
    full_attention_interval=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)


def overrides_of(names: tuple[str, ...], shapes: dict) -> dict:
    """The family options among a caller's overrides (taken out of `shapes`)."""
    return {name: shapes.pop(name) for name in names if name in shapes}


def _hybrid_settings(shapes: dict, overrides, *, mrope: bool) -> dict:
    """What the Qwen3.5 and Qwen3-Next configs share: the layer kinds and DeltaNet sizes
    (TINY_SHAPES' layer count taken out of `shapes`, a caller's overrides kept), Qwen3.5's
    rotary (a quarter of each head rotates: 8 of 32 dimensions here; Qwen3.5's with its
    multimodal sections), untied embeddings and the special ids."""
    overrides_of(tuple(QWEN35_LAYERS), shapes)
    layers = {**QWEN35_LAYERS, **overrides_of(tuple(QWEN35_LAYERS), dict(overrides))}
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    if mrope:
        rope |= {"mrope_section": [11, 11, 10], "mrope_interleaved": True}
    return dict(
        **layers,
        rope_parameters=rope,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
    )


def write_tiny_model(
    folder: Path,
    family: str = "llama",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Write a tiny random model of `family` ("gemma3_text", "gpt_oss", "llama", "llama3",
    "ministral3", "phi3", "qwen2", "qwen3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_moe",
    "qwen3_next", "smollm3") into `folder`."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Ministral3Config,
        Ministral3ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    torch.manual_seed(seed)
    shapes = {**TINY_SHAPES, "vocab_size": vocab_size, **overrides}
    # transformers writes stacked experts back one file tensor an expert; False: as held
    original_format = True
    if family == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's configs do
        config = Qwen3Config(
            **{"head_dim": 32, **shapes}, tie_word_embeddings=True, rope_theta=1_000_000.0
        )
        model = Qwen3ForCausalLM(config)
    elif family == "smollm3":  # four layers, so the fourth attends without rotary
        config = SmolLM3Config(
            **{**shapes, "num_hidden_layers": max(4, shapes["num_hidden_layers"])},
            rope_theta=5_000_000.0,
            pad_token_id=None,  # its default, 128004, lies beyond a tiny vocabulary
            bos_token_id=1,
            eos_token_id=2,
        )
        model = SmolLM3ForCausalLM(config)
    elif family == "phi3":
        config = Phi3Config(**shapes, **PHI3_ROPE, tie_word_embeddings=True, pad_token_id=None)
        model = Phi3ForCausalLM(config)
    elif family == "qwen3_moe":
        # Qwen3-30B-A3B's routing scaled down: 8 of 128 experts there, 2 of 8 here,
        # renormalized; a dense layer first (mlp_only_layers) as such configs allow
        routing = {
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            **overrides_of(("norm_topk_prob", "mlp_only_layers"), shapes),
        }
        config = Qwen3MoeConfig(
            **{"head_dim": 32, **shapes, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            tie_word_embeddings=False,
            rope_theta=1_000_000.0,
            **routing,
        )
        model = Qwen3MoeForCausalLM(config)
    elif family == "gemma3_text":
        # Gemma 3 1B's pattern (five windowed layers, then a global one) with a window of
        # GEMMA3_WINDOW tokens, so short prompts outgrow it
        scalar = {"query_pre_attn_scalar": 16, **overrides_of(("query_pre_attn_scalar",), shapes)}
        config = Gemma3TextConfig(
            **{"head_dim": 16, **shapes, "num_hidden_layers": 6},
            sliding_window=GEMMA3_WINDOW,
            **scalar,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        model = Gemma3ForCausalLM(config)
    elif family == "gpt_oss":
        # gpt-oss-20b's routing and layer pattern scaled down: 4 of 32 experts there, 2 of 8
        # here; windowed and global layers alternating, a window of GPT_OSS_WINDOW tokens
        config = GptOssConfig(
            **{"head_dim": 16, **shapes, "num_hidden_layers": 4},
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=GPT_OSS_WINDOW,
            rope_parameters={**GPT_OSS_ROPE},
            pad_token_id=None,
        )
        model = GptOssForCausalLM(config)
    elif family == "ministral3":
        config = Ministral3Config(
            **{
                "head_dim": 16,
                **shapes,
                "max_position_embeddings": 16 * MINISTRAL3_ORIGINAL_CONTEXT,
            },
            rope_parameters=MINISTRAL3_ROPE,
            pad_token_id=None,
        )
        model = Ministral3ForCausalLM(config)
    elif family == "qwen3_5_text":
        hybrid = _hybrid_settings(shapes, overrides, mrope=True)
        config = Qwen3_5TextConfig(**{"head_dim": 32, **shapes}, **hybrid)
        model = Qwen3_5ForCausalLM(config)
    elif family == "qwen3_next":
        # Qwen3.5's layers with Qwen3-Next-80B-A3B's routing scaled down (10 of 512 experts
        # and a shared one there, 2 of 8 and a shared one here), a dense layer first
        hybrid = _hybrid_settings(shapes, overrides, mrope=False)
        dense = shapes.pop("mlp_only_layers", [0])  # none in llama.cpp's files
        config = Qwen3NextConfig(
            **{"head_dim": 32, **shapes},
            **hybrid,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=dense,
        )
        model = Qwen3NextForCausalLM(config)
    elif family == "qwen3_5_moe_text":
        # Qwen3.5's layers with Qwen3.5-35B-A3B's routing scaled down (8 of 256 experts and
        # a shared one there, 2 of 8 and a shared one here) in every layer; the experts
        # written stacked, as the hub's files hold them
        hybrid = _hybrid_settings(shapes, overrides, mrope=True)
        shapes.pop("intermediate_size")  # no dense feed-forward: not a key of its config
        config = Qwen3_5MoeTextConfig(
            **{"head_dim": 32, **shapes},
            **hybrid,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
        model = Qwen3_5MoeForCausalLM(config)
        original_format = False
    elif family == "qwen2":
        config = Qwen2Config(**shapes, tie_word_embeddings=True, rope_theta=1_000_000.0)
        model = Qwen2ForCausalLM(config)
    elif family == "llama3":
        config = LlamaConfig(
            **shapes,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
        model = LlamaForCausalLM(config)
    else:
        config = LlamaConfig(**shapes, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; scale weights up so tokens differ clearly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
        for name, p in model.named_parameters():  # q/k norms start at ones: make them count
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif family == "gemma3_text" and name == "model.norm.weight":
                # the last norm feeds the tied head: a factor of ~15 makes the logits peaked
                # enough that greedy text means something (llama-server's agrees with it)
                p.uniform_(10.0, 20.0)
            elif family == "gemma3_text" and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # Gemma's start at zeros (a factor of 1 + w)
            elif family in HYBRID and name == "model.norm.weight":
                p.uniform_(2.0, 4.0)  # (1 + w) of 3 to 5: peaked logits, as Gemma's above
            elif family in HYBRID and name.endswith("layernorm.weight"):
                p.uniform_(-0.5, 0.5)  # start at zeros (1 + w); the gated norm's is a plain w
            elif family in HYBRID and name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif family in STACKED_EXPERTS and "experts" in name and p.dim() == 3:
                p.normal_(0.0, 0.1)  # stacked experts start at zeros, and are not scaled above
            elif family == "gpt_oss" and name.endswith("sinks"):
                p.normal_(0.0, 1.0)  # a sink comparable to a row's scores
            elif family == "gpt_oss" and (name.endswith("bias") or "experts" in name):
                p.normal_(0.0, 0.1)  # the stacked experts are 3-d: not scaled above
    model.save_pretrained(folder, safe_serialization=True, save_original_format=original_format)
    if with_tokenizer:
        from tests.tiny_tokenizers import write_tiny_tokenizer

        write_tiny_tokenizer(folder, "llama3" if family == "llama3" else "chatml")
    return folder
