"""From a llama.cpp GGUF to what kvchat's loader reads from a Hugging Face directory.

kvchat's model code is written against Hugging Face config.json keys and
tensor names. A GGUF of the same family carries the same numbers under
llama.cpp's names, so this module translates both: `gguf_to_hf_config` builds
a config.json dict from the metadata, `gguf_state_dict` yields the weights,
dequantized, under Hugging Face names.

One translation is not a rename: llama.cpp's converter permutes the rows of
the query and key projections of the `llama` architecture (from Hugging Face's
"rotate half" rotary layout to GPT-J's interleaved one). Skipping the
inverse gives a model that runs and talks plausible nonsense, so it is undone
here, exactly as transformers' GGUF loader does (`smollm3`'s converter derives from
the `llama` one and permutes too, as does Ministral 3's `mistral3`). `qwen2` and `qwen3`
are converted without that permutation (llama.cpp's Qwen2 converter, which Qwen3's
derives from, does not apply it); Qwen3's per-head q/k norms are `attn_q_norm` / `attn_k_norm`.

`gemma3`'s converter adds 1 to every norm weight (llama.cpp multiplies by the weight,
Gemma by 1 + w): subtracted here. Its files say the window and both rotary bases but not
which layers are windowed, nor the query scale: llama.cpp fixes both (five windowed layers
to one global; head_dim, or hidden / heads for the 62-layer 27B), and so does this module.

The hybrids, `qwen35` (Qwen3.5, text), `qwen35moe` (Qwen3.5-MoE, text) and `qwen3next`
(Qwen3-Next), take the most undoing: norms with 1 added, A as -exp(A_log), Qwen3.5's value
heads reordered and Qwen3-Next's q/k/v/z projection split (`_HybridTensors`); their
multi-token-prediction blocks, appended to the layers by the converter, are skipped
(`decoder_layers`). Qwen3.5-MoE's layers are Qwen3.5's with Qwen3-Next's feed-forward:
experts stacked as Qwen3-MoE's (`ffn_*_exps`, the converter splitting the checkpoint's
fused gate/up), a shared expert (`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import numpy as np
import torch

from kvchat.errors import ModelLoadError
from kvchat.model.gguf.dequant import dequantize
from kvchat.model.gguf.file import GGUFFile

SUPPORTED_ARCHITECTURES = (
    "gemma3", "gpt-oss", "llama", "mistral3", "phi3", "qwen2", "qwen3", "qwen35", "qwen35moe",
    "qwen3moe", "qwen3next", "smollm3",
)  # fmt: skip
# Qwen3.5 (text), Qwen3.5-MoE (text) and Qwen3-Next: Gated DeltaNet layers beside gated
# full attention
HYBRID_ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
# the hybrids with experts and a shared expert in every layer
HYBRID_MOE_ARCHITECTURES = ("qwen35moe", "qwen3next")
# the architectures whose q/k rows llama.cpp's converter permutes (`llama_cpp_permute`)
PERMUTED_ARCHITECTURES = ("llama", "mistral3", "smollm3")
# llama.cpp runs SmolLM3 with rotary left out of every fourth layer; the file does not say
SMOLLM3_NO_ROPE_INTERVAL = 4
# llama.cpp's Gemma 3: every sixth layer global, and the 62-layer model (27B) scaling its
# queries by hidden / heads rather than head_dim (the files say neither)
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_27B_LAYERS = 62

_HF_ARCH = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "mistral3": ("ministral3", "Ministral3ForCausalLM"),
    "gpt-oss": ("gpt_oss", "GptOssForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
}

# GGUF tensor name -> Hugging Face name; {i} is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # qwen3moe's router
}
# Qwen3-MoE's experts, one 3-d tensor [experts, rows, columns] each: a tensor per expert
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
# Phi-3 keeps Hugging Face's fused q/k/v and gate/up matrices (gate first, as there);
# Gemma 3 normalizes after attention and around the feed-forward
_ARCH_LAYER_NAMES = {
    "phi3": {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    # gpt-oss: the experts stay stacked (gate and up apart, as llama.cpp splits them; MXFP4
    # in its files), each with a bias, the router biased, a sink per head
    "gpt-oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        **{
            f"ffn_{part}_exps.{kind}": f"mlp.experts.{part}_proj.{kind}"
            for part in ("gate", "up", "down")
            for kind in ("weight", "bias")
        },
    },
}
# Qwen3.5, Qwen3.5-MoE and Qwen3-Next: the linear-attention layers' tensors (llama.cpp's
# `ssm_*`; the converter's `attn_qkv` / `attn_gate` are the Gated DeltaNet's q/k/v and z
# projections), the norm after attention, the MoE models' shared expert and its gate
_HYBRID_LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    **{
        f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight"
        for p in ("gate", "up", "down")
    },
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_ARCH_LAYER_NAMES.update(dict.fromkeys(HYBRID_ARCHITECTURES, _HYBRID_LAYER_NAMES))
# llama.cpp's gpt-oss: every other layer windowed, from the first (the file does not say)
GPT_OSS_SLIDING_PATTERN = 2
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors that describe the model rather than hold weights: read into the config.
_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def check_architecture(metadata: dict[str, object]) -> str:
    """`general.architecture` if kvchat runs it, else a `ModelLoadError`."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch}; kvchat runs GGUFs of the gemma3 (text), llama "
            "(Llama, Mistral, SmolLM2), mistral3 (Ministral 3), phi3 (Phi-3, Phi-4-mini), "
            "qwen2, qwen3, qwen35 (Qwen3.5, text), qwen35moe (Qwen3.5-MoE, text), qwen3moe, "
            "qwen3next (Qwen3-Next) and smollm3 architectures. Choose a GGUF of one of those."
        )
    return str(arch)


def _required(metadata: dict[str, object], key: str) -> object:
    if key not in metadata:
        raise ModelLoadError(f"the GGUF metadata lacks {key!r}; the file is incomplete or corrupt.")
    return metadata[key]


def _f32(value: object) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def gguf_to_hf_config(gguf: GGUFFile) -> dict[str, object]:
    """A Hugging Face style config.json dict for the model in `gguf`.

    Needs the whole file, not only its metadata: whether the embeddings are
    tied follows from the absence of `output.weight`, and Llama 3.x rope
    scaling is stored as a `rope_freqs` tensor rather than as metadata.
    """
    if not isinstance(gguf, GGUFFile):
        raise TypeError(
            "gguf_to_hf_config needs the GGUFFile, not its metadata: tie_word_embeddings "
            "and rope scaling depend on which tensors the file holds"
        )
    md = gguf.metadata
    arch = check_architecture(md)
    model_type, hf_class = _HF_ARCH[arch]

    hidden = int(_required(md, f"{arch}.embedding_length"))  # type: ignore[arg-type]
    n_heads = int(_required(md, f"{arch}.attention.head_count"))  # type: ignore[arg-type]
    n_kv_heads = int(md.get(f"{arch}.attention.head_count_kv", n_heads))  # type: ignore[arg-type]
    head_dim = md.get(f"{arch}.attention.key_length")
    if head_dim is None and arch in PERMUTED_ARCHITECTURES:
        head_dim = md.get(f"{arch}.rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads  # type: ignore[arg-type]

    embed = gguf.tensors.get("token_embd.weight")
    vocab_size = md.get(f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab_size = embed.shape[0] if embed else len(tokens) if isinstance(tokens, list) else None
    if vocab_size is None:
        raise ModelLoadError("the GGUF says nothing of its vocabulary size; the file is corrupt.")

    # Qwen3.5-MoE has no dense feed-forward: its files, like its config, give no size
    dense_ff = (
        md.get(f"{arch}.feed_forward_length") or 0
        if arch == "qwen35moe"
        else _required(md, f"{arch}.feed_forward_length")
    )
    config: dict[str, object] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "intermediate_size": int(dense_ff),  # type: ignore[call-overload]
        "num_hidden_layers": decoder_layers(md, arch),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(md.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(md.get(f"{arch}.context_length", 2048)),  # type: ignore[arg-type]
        "vocab_size": int(vocab_size),  # type: ignore[arg-type]
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensors,
        "hidden_act": "silu",
    }
    if arch == "smollm3":
        config["no_rope_layer_interval"] = SMOLLM3_NO_ROPE_INTERVAL
    if arch == "qwen3moe":
        config.update(_experts(gguf, arch, int(config["num_hidden_layers"])))  # type: ignore[call-overload]
    if arch == "gemma3":
        config.update(_gemma3(md, arch, config))
    if arch == "gpt-oss":
        config.update(_gpt_oss(md, arch, config))
    if arch in HYBRID_ARCHITECTURES:
        config.update(_hybrid(gguf, arch, config))
    rope_dims = md.get(f"{arch}.rope.dimension_count")
    if (
        arch in ("phi3", *HYBRID_ARCHITECTURES)
        and rope_dims is not None
        and int(rope_dims) != head_dim
    ):  # type: ignore[call-overload]
        config["partial_rotary_factor"] = int(rope_dims) / head_dim  # type: ignore[call-overload]
    for gguf_key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if gguf_key in md:
            config[hf_key] = int(md[gguf_key])  # type: ignore[call-overload]

    rope_scaling = _rope_scaling(gguf, arch, head_dim, float(config["rope_theta"]))  # type: ignore[arg-type]
    if rope_scaling is not None and arch == "gpt-oss":
        rope_scaling["truncate"] = False  # gpt-oss's YaRN bounds are not rounded
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    beta = md.get(f"{arch}.attention.temperature_scale")
    if arch == "mistral3" and rope_scaling is not None and beta:
        # Ministral 3's query scaling sits with its rotary, as in its config.json
        config["rope_parameters"] = {
            **rope_scaling,
            "rope_theta": config["rope_theta"],
            "llama_4_scaling_beta": _f32(beta),
        }
    return config


def decoder_layers(md: dict[str, object], arch: str) -> int:
    """The decoder layers of the file: its `block_count` less the multi-token-prediction
    (nextn) blocks llama.cpp's converter appends to Qwen3.5's and Qwen3-Next's, which
    kvchat does not run (their tensors are skipped)."""
    blocks = int(_required(md, f"{arch}.block_count"))  # type: ignore[call-overload]
    return blocks - int(md.get(f"{arch}.nextn_predict_layers") or 0)  # type: ignore[call-overload]


def _hybrid(gguf: GGUFFile, arch: str, config: dict[str, object]) -> dict[str, object]:
    """Qwen3.5's, Qwen3.5-MoE's and Qwen3-Next's fields: each layer's kind from the file's
    `attention.recurrent_layers` (else every `full_attention_interval`-th layer attends),
    the Gated DeltaNet's sizes from the `ssm.*` keys as the converter writes them (state
    size: key head size; group count: key heads; time-step rank: value heads; inner
    size: all value heads' width), the MoE models' experts and shared expert (every layer
    sparse: Qwen3.5-MoE has no other kind, and llama.cpp's converter refuses Qwen3-Next's
    dense ones)."""
    md = gguf.metadata
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    recurrent = md.get(f"{arch}.attention.recurrent_layers")
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise ModelLoadError(
                f"the GGUF's attention.recurrent_layers has {len(recurrent)} entries for "
                f"{layers} layers; the file is corrupt."
            )
        linear = [bool(r) for r in recurrent[:layers]]
    else:
        interval = int(md.get(f"{arch}.full_attention_interval") or 4)  # type: ignore[call-overload]
        linear = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = int(_required(md, f"{arch}.ssm.time_step_rank"))  # type: ignore[call-overload]
    fields: dict[str, object] = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in linear],
        "linear_conv_kernel_dim": int(_required(md, f"{arch}.ssm.conv_kernel")),  # type: ignore[call-overload]
        "linear_key_head_dim": int(_required(md, f"{arch}.ssm.state_size")),  # type: ignore[call-overload]
        "linear_num_key_heads": int(_required(md, f"{arch}.ssm.group_count")),  # type: ignore[call-overload]
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": int(_required(md, f"{arch}.ssm.inner_size")) // v_heads,  # type: ignore[call-overload]
    }
    if arch in HYBRID_MOE_ARCHITECTURES:
        fields.update(_experts(gguf, arch, layers))
        fields["shared_expert_intermediate_size"] = int(
            md.get(f"{arch}.expert_shared_feed_forward_length") or 0  # type: ignore[call-overload]
        )
    return fields


def _gemma3(md: dict[str, object], arch: str, config: dict[str, object]) -> dict[str, object]:
    """Gemma 3's fields, as llama.cpp runs its files (`GEMMA3_SLIDING_PATTERN`)."""
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    window = md.get(f"{arch}.attention.sliding_window")
    scalar = (
        int(config["hidden_size"]) // int(config["num_attention_heads"])  # type: ignore[call-overload]
        if layers == GEMMA3_27B_LAYERS
        else config["head_dim"]
    )
    fields: dict[str, object] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(window) if window else None,  # type: ignore[call-overload]
        "sliding_window_pattern": GEMMA3_SLIDING_PATTERN if window else 1,
        "rope_local_base_freq": _f32(md.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": scalar,
    }
    cap = md.get(f"{arch}.final_logit_softcapping")
    if cap:
        fields["final_logit_softcapping"] = _f32(cap)
    return fields


def _gpt_oss(md: dict[str, object], arch: str, config: dict[str, object]) -> dict[str, object]:
    """gpt-oss's fields, as llama.cpp runs its files (`GPT_OSS_SLIDING_PATTERN`, YaRN's
    bounds not rounded, transformers' `truncate: false` for this family)."""
    layers = int(config["num_hidden_layers"])  # type: ignore[call-overload]
    window = md.get(f"{arch}.attention.sliding_window")
    kinds = [
        "sliding_attention" if window and i % GPT_OSS_SLIDING_PATTERN == 0 else "full_attention"
        for i in range(layers)
    ]
    fields: dict[str, object] = {
        "num_local_experts": int(_required(md, f"{arch}.expert_count")),  # type: ignore[call-overload]
        "num_experts_per_tok": int(_required(md, f"{arch}.expert_used_count")),  # type: ignore[call-overload]
        "intermediate_size": int(
            md.get(f"{arch}.expert_feed_forward_length", config["intermediate_size"])  # type: ignore[call-overload]
        ),
        "sliding_window": int(window) if window else None,  # type: ignore[call-overload]
        "layer_types": kinds,
        "attention_bias": True,
    }
    return fields


def _experts(gguf: GGUFFile, arch: str, layers: int) -> dict[str, object]:
    """Qwen3-MoE's expert fields, and the MoE hybrids'. llama.cpp always renormalizes the
    chosen experts' weights for these architectures (the file has no key for it), and which
    layers are dense shows in the tensors: those without a router."""
    md = gguf.metadata
    return {
        "num_experts": int(_required(md, f"{arch}.expert_count")),  # type: ignore[call-overload]
        "num_experts_per_tok": int(_required(md, f"{arch}.expert_used_count")),  # type: ignore[call-overload]
        "moe_intermediate_size": int(
            _required(md, f"{arch}.expert_feed_forward_length")  # type: ignore[call-overload]
        ),
        "norm_topk_prob": bool(md.get(f"{arch}.expert_weights_norm", True)),
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors
        ],
    }


def _rope_scaling(
    gguf: GGUFFile, arch: str, head_dim: int, theta: float
) -> dict[str, object] | None:
    md = gguf.metadata
    if "rope_factors_long.weight" in gguf.tensors:
        return _longrope_scaling(gguf, arch)
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind is not None and kind != "none":
        if kind not in ("linear", "yarn"):
            raise ModelLoadError(f"the GGUF uses rope scaling {kind!r}, which kvchat does not run.")
        scaling: dict[str, object] = {
            "rope_type": kind,
            "factor": _f32(_required(md, f"{arch}.rope.scaling.factor")),
        }
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)  # type: ignore[call-overload]
        if kind == "yarn":
            scaling.update(_yarn_fields(md, arch))
        return scaling
    if "rope_freqs.weight" in gguf.tensors:
        info = gguf.tensors["rope_freqs.weight"]
        factors = dequantize(gguf.raw(info.name), info.ggml_type, info.shape).double()
        return _llama3_rope_scaling(factors, head_dim, theta)
    return None


def _yarn_fields(md: dict[str, object], arch: str) -> dict[str, object]:
    """YaRN's ramp bounds and attention scale as the converter writes them: `yarn_log_mul`
    is transformers' `mscale_all_dim` (Ministral 3's; its `mscale` is the same 1)."""
    fields: dict[str, object] = {}
    for key, name in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        value = md.get(f"{arch}.rope.scaling.{key}")
        if value is not None:
            fields[name] = _f32(value)
    log_mul = md.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_mul:
        fields["mscale"] = fields["mscale_all_dim"] = _f32(log_mul)
    return fields


def _longrope_scaling(gguf: GGUFFile, arch: str) -> dict[str, object]:
    """Phi-3's LongRoPE: llama.cpp's converter writes its two factor sets as tensors and
    the attention factor and original context as metadata, not a scaling type."""
    md = gguf.metadata
    factors = {}
    for which in ("long", "short"):
        info = gguf.tensors.get(f"rope_factors_{which}.weight")
        if info is None:
            raise ModelLoadError(
                f"the GGUF has LongRoPE factors without rope_factors_{which}; the file is "
                "incomplete. Convert the model again."
            )
        values = dequantize(gguf.raw(info.name), info.ggml_type, info.shape)
        factors[which] = [_f32(v) for v in values.tolist()]
    scaling: dict[str, object] = {
        "rope_type": "longrope",
        "long_factor": factors["long"],
        "short_factor": factors["short"],
        "original_max_position_embeddings": int(
            _required(md, f"{arch}.rope.scaling.original_context_length")  # type: ignore[call-overload]
        ),
    }
    # the file's attention factor is the float32 rounding of the one transformers derives
    # from the two context lengths: kept only where it is another value
    attention = md.get(f"{arch}.rope.scaling.attn_factor")
    original = int(scaling["original_max_position_embeddings"])  # type: ignore[call-overload]
    ratio = int(md.get(f"{arch}.context_length", original)) / original  # type: ignore[call-overload]
    derived = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    if attention is not None and abs(float(attention) - derived) > 1e-6:  # type: ignore[arg-type]
        scaling["attention_factor"] = float(attention)  # type: ignore[arg-type]
    return scaling


def _llama3_rope_scaling(factors: torch.Tensor, head_dim: int, theta: float) -> dict[str, object]:
    """Recover Llama 3.x's `rope_scaling` from the per-frequency divisors llama.cpp stores.

    llama.cpp bakes the Llama 3 scaling into a `rope_freqs` tensor. Every
    Llama 3.1/3.2/3.3 release uses low_freq_factor 1, high_freq_factor 4 and
    an original context of 8192; only `factor` varies, and it is the largest
    divisor. We rebuild the divisors from those parameters and refuse the file
    if they do not match, rather than run it with a wrong rotary embedding.
    """
    factor = float(factors.max())
    params: dict[str, object] = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expected = torch.where(
        wavelen < high_wavelen,
        torch.ones_like(wavelen),
        torch.where(
            wavelen > low_wavelen,
            torch.full_like(wavelen, factor),
            1.0 / ((1 - smooth) / factor + smooth),
        ),
    )
    if factors.shape != expected.shape or not torch.allclose(factors, expected, rtol=1e-3):
        raise ModelLoadError(
            "the GGUF's rope_freqs tensor is not Llama 3 rope scaling as kvchat knows it; "
            "use the model's Hugging Face directory instead."
        )
    return params


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors that are config, not weights."""
    if gguf_name in _CONFIG_TENSORS:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    arch_names = _ARCH_LAYER_NAMES.get(arch, {})
    if match and match.group(2) in arch_names:
        return f"model.layers.{match.group(1)}.{arch_names[match.group(2)]}"
    if match and match.group(2) in _EXPERT_NAMES:  # one per expert: `expert_tensors`
        return (
            f"model.layers.{match.group(1)}.mlp.experts.{{}}.{_EXPERT_NAMES[match.group(2)]}.weight"
        )
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ModelLoadError(
        f"the GGUF holds a tensor {gguf_name!r} that kvchat's Llama-family model has no place "
        f"for; the file is not a plain {arch} model."
    )


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's row permutation of attn_q/attn_k (convert_hf_to_gguf.py, LlamaModel.permute).

    Within each head, rows [first half | second half] become interleaved
    pairs. Kept here as the reference the inverse is tested against.
    """
    half = w.shape[0] // n_heads // 2
    # [n_heads * head_dim, ...] -> [n_heads, 2, half, ...] -> [n_heads, half, 2, ...]
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def undo_llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `llama_cpp_permute`: back to Hugging Face's rotate-half row order."""
    half = w.shape[0] // n_heads // 2
    # [n_heads * head_dim, ...] -> [n_heads, half, 2, ...] -> [n_heads, 2, half, ...]
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(gguf: GGUFFile, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every weight of `gguf`, dequantized and cast to `dtype`.

    One tensor at a time, so peak memory is one float32 tensor above the
    model itself. `lm_head.weight` is absent when the embeddings are tied
    (see the config's `tie_word_embeddings`).
    """
    md = gguf.metadata
    arch = check_architecture(md)
    n_heads = int(_required(md, f"{arch}.attention.head_count"))  # type: ignore[arg-type]
    n_kv_heads = int(md.get(f"{arch}.attention.head_count_kv", n_heads))  # type: ignore[arg-type]
    layers = decoder_layers(md, arch)
    hybrid = _HybridTensors(gguf_to_hf_config(gguf)) if arch in HYBRID_ARCHITECTURES else None
    for name, info in gguf.tensors.items():
        match = _LAYER_RE.match(name)
        if match and int(match.group(1)) >= layers:
            continue  # a multi-token-prediction (nextn) block: kvchat does not run it
        hf_name = hf_tensor_name(name, arch)
        if hf_name is None:
            continue
        weight = dequantize(gguf.raw(name), info.ggml_type, info.shape)  # float32, torch order
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # the converter's 1 + w, back to Gemma's w
        if hybrid is not None and "{}" not in hf_name:
            yield from hybrid.restore(hf_name, weight.float(), dtype)
            continue
        if arch in PERMUTED_ARCHITECTURES:
            if ".attn_q." in name:
                weight = undo_llama_cpp_permute(weight, n_heads)
            elif ".attn_k." in name:
                weight = undo_llama_cpp_permute(weight, n_kv_heads)
        if "{}" in hf_name:  # experts stacked in one tensor: one each, as HF names them
            for expert, part in enumerate(weight):
                yield hf_name.format(expert), part.to(dtype, copy=True)  # not views of one
            continue
        yield hf_name, weight.to(dtype)


def grouped_order(k_heads: int, v_heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of llama.cpp's `_reorder_v_heads` (Qwen3.5's value heads) as an index:
    entry j of the grouped order ([K0: v0 v1 | K1: v0 v1], as the checkpoint holds them)
    is the position in the file's tiled order ([v0: K0 K1 | v1: K0 K1]) of the row or
    column the checkpoint has at j, `head_dim` of them a head."""
    per_k = v_heads // k_heads
    tiled = torch.arange(v_heads * head_dim).view(per_k, k_heads, head_dim)
    return tiled.transpose(0, 1).reshape(-1)


class _HybridTensors:
    """Qwen3.5's (dense and MoE) and Qwen3-Next's tensors back as their Hugging Face
    checkpoints hold them (but the experts, which go one each as Qwen3-MoE's), undoing
    each change llama.cpp's converter (`Qwen3NextModel`, `_LinearAttentionVReorderBase` in
    its conversion/qwen.py) makes:

    - every decoder norm but the DeltaNet's own holds 1 + w (Gemma's way): w again;
    - `ssm_a` is -exp(A_log): A_log again; `ssm_conv1d` lost its middle dimension of 1;
    - Qwen3.5's value heads (with their z, b, a, A, dt_bias, convolution channels and
      out_proj columns) are reordered from grouped by key head ([K0: v0 v1 | K1: v0 v1])
      to tiled ([v0: K0 K1 | v1: K0 K1]) where there are more value heads than key heads:
      grouped again;
    - Qwen3-Next's fused `in_proj_qkvz` (per key head: q, k, its values' v, their z) is
      split into q/k/v of all heads (`attn_qkv`) and z (`attn_gate`): fused again, so the
      pair is held until both have been read. `in_proj_ba` is the file's `ssm_ba` as is.
    """

    def __init__(self, config: dict[str, object]):
        self.k_heads = int(config["linear_num_key_heads"])  # type: ignore[call-overload]
        self.v_heads = int(config["linear_num_value_heads"])  # type: ignore[call-overload]
        self.k_dim = int(config["linear_key_head_dim"])  # type: ignore[call-overload]
        self.v_dim = int(config["linear_value_head_dim"])  # type: ignore[call-overload]
        qwen35 = config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text")
        self.reordered = qwen35 and self.k_heads != self.v_heads
        self.fused = config["model_type"] == "qwen3_next"
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def grouped(self, w: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        """The inverse of the converter's `_reorder_v_heads` along `dim`."""
        if not self.reordered:
            return w
        return w.index_select(dim, grouped_order(self.k_heads, self.v_heads, head_dim))

    def restore(
        self, hf_name: str, w: torch.Tensor, dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        local = hf_name.rpartition(".linear_attn.")[2]
        qk = 2 * self.k_heads * self.k_dim
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            w = w - 1.0
        elif local == "A_log":
            w = torch.log(-self.grouped(w[:, None], 0, 1)[:, 0])
        elif local == "dt_bias":
            w = self.grouped(w[:, None], 0, 1)[:, 0]
        elif local in ("in_proj_a.weight", "in_proj_b.weight"):
            w = self.grouped(w, 0, 1)
        elif local == "in_proj_z.weight":
            w = self.grouped(w, 0, self.v_dim)
        elif local == "out_proj.weight":
            w = self.grouped(w, 1, self.v_dim)
        elif local == "conv1d.weight":  # [channels, K]: q, k, then v channels
            w = torch.cat([w[:qk], self.grouped(w[qk:], 0, self.v_dim)])[:, None, :]
        elif local == "in_proj_qkv.weight":
            w = torch.cat([w[:qk], self.grouped(w[qk:], 0, self.v_dim)])
        if self.fused and local in ("in_proj_qkv.weight", "in_proj_z.weight"):
            prefix = hf_name.rpartition(".in_proj_")[0]
            held = self.pending.setdefault(prefix, {})
            held[local] = w
            if len(held) < 2:
                return
            del self.pending[prefix]
            yield f"{prefix}.in_proj_qkvz.weight", self.qkvz(held).to(dtype)
            return
        yield hf_name, w.to(dtype)

    def qkvz(self, held: dict[str, torch.Tensor]) -> torch.Tensor:
        """Qwen3-Next's `in_proj_qkvz` from the file's q/k/v and z: per key head, its q,
        k, then the v and z of the value heads it serves."""
        qkv, z = held["in_proj_qkv.weight"], held["in_proj_z.weight"]
        hidden = qkv.shape[-1]
        kd = self.k_heads * self.k_dim
        q, k, v = qkv.split([kd, kd, qkv.shape[0] - 2 * kd])
        groups = [t.reshape(self.k_heads, -1, hidden) for t in (q, k, v, z)]
        return torch.cat(groups, dim=1).reshape(-1, hidden)
