"""The transformer's shape, read from a Hugging Face `config.json` dict.

One dataclass for the Llama family and the families that add a step to it: Llama
2/3.x, Mistral, Qwen2/2.5 and SmolLM2 differ only in values (q/k/v bias, rope scaling,
tied embeddings); Qwen3 adds a per-head RMSNorm of q and k before rotary (`qk_norm`);
SmolLM3 leaves rotary out of every fourth layer (`rope_layers`); models that attend
within a window (`sliding_window`) run with their context capped at it; Phi-3 / Phi-4-mini fuse
q/k/v and gate/up in their files (split on load, `fused_weights`), rotate only part of
each head (`partial_rotary_factor`) and scale rotary by LongRoPE's per-frequency factors;
Qwen3-MoE replaces the feed-forward of its sparse layers by experts (`num_experts`), as
gpt-oss does in every layer (its router biased, its SwiGLU clamped: `expert_kind`), which
also adds a learned sink to each head's softmax (`attention_sinks`) and windows every
other layer;
Gemma 3 attends within a window in five layers of six (`layer_windows`) with a rotary
base of their own, normalizes with (1 + w) before and after attention and the
feed-forward, scales its embeddings and queries and feeds forward through GELU (`gemma`);
Qwen3.5 is hybrid: three layers in four replace attention by a linear-attention layer
(Gated DeltaNet, `layer_kinds`, `delta_net`) whose memory is a per-sequence state rather
than K/V (the engine keeps one per sequence), and its norms multiply by (1 + w) as
Gemma's do; Qwen3-Next is the same hybrid with Qwen3-MoE's experts and a gated shared
expert beside them (`shared_expert_size`), and Qwen3.5-MoE is Qwen3.5 with Qwen3-Next's
feed-forward in every layer (its experts stacked in its files). Anything else is refused
here, with a message, before any weight is read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = (
    "gemma3_text", "gpt_oss", "llama", "ministral3", "mistral", "phi3", "qwen2", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "smollm3",
)  # fmt: skip
SUPPORTED_FAMILIES = (
    "Gemma 3 (text), gpt-oss, Llama 2/3.x, Ministral 3, Mistral, Phi-3 / Phi-4-mini, "
    "Qwen2/2.5, Qwen3 (dense and MoE), Qwen3.5 (dense and MoE), Qwen3-Next, SmolLM2, "
    "SmolLM3, TinyLlama"
)
GPT_OSS = "gpt_oss"
# vision-language checkpoints whose text model kvchat runs (their images are not read)
TEXT_MODEL_OF = {
    "gemma3": "gemma3_text",
    "mistral3": "ministral3",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
GEMMA3 = "gemma3_text"
QWEN35 = "qwen3_5_text"
QWEN35_MOE = "qwen3_5_moe_text"
QWEN3_NEXT = "qwen3_next"
# Models with linear-attention layers beside full attention (`qwen35_layer`): the engine
# keeps a state per sequence and linear layer beside the K/V pages (`sequence_states`)
HYBRID_MODEL_TYPES = (QWEN35, QWEN35_MOE, QWEN3_NEXT)
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config leaves most out
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 4096,
    "query_pre_attn_scalar": 256,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's frequency-dependent rope scaling ("llama3"), "linear", Phi-3's
    "longrope" (a divisor per frequency, one set for contexts up to the original length
    and one beyond it) or "yarn" (frequencies between `beta_fast` and `beta_slow`
    rotations over the original context blended from interpolated to kept); the last two
    scale cos/sin by `attention_factor`."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # YaRN's blend bounds rounded outward to whole dimensions


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes, from the text config's `linear_*` keys
    (`gated_deltanet` computes the layer; the shape lives here so that the config, and the
    engine sizing its states from it, need no torch).

    Key heads may be fewer than value heads: each key (and query) head serves
    `num_v_heads // num_k_heads` consecutive value heads (16 and 32 in transformers'
    defaults for both families)."""

    hidden_size: int
    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads
    head_k_dim: int  # linear_key_head_dim
    head_v_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim (4 by default)
    rms_norm_eps: float

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DeltaNetShape:
        """From a Hugging Face text config (a dict: `text_config` for Qwen3.5's
        multimodal checkpoints, the top level for Qwen3-Next)."""
        return cls(
            hidden_size=config["hidden_size"],
            num_k_heads=config["linear_num_key_heads"],
            num_v_heads=config["linear_num_value_heads"],
            head_k_dim=config["linear_key_head_dim"],
            head_v_dim=config["linear_value_head_dim"],
            conv_kernel=config.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The convolved channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rotary
    # SmolLM3: which layers rotate q and k (the others attend without positions); None: all
    rope_layers: tuple[bool, ...] | None = None
    partial_rotary_factor: float = 1.0  # Phi-3: the share of each head that rotates
    # Mistral 7B v0.1, Phi-3-mini, Qwen with use_sliding_window: each token attends to the
    # last `sliding_window` tokens only. kvchat runs such a model with its context capped
    # at the window, where windowed and full attention are the same computation.
    sliding_window: int | None = None
    # Qwen3-MoE: experts, how many a token uses, their width, whether the chosen weights
    # are renormalized to sum to 1, and which layers are sparse (`layer_is_sparse`)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # "qwen": softmax over all experts, then top-k; "gpt_oss": top-k of the router's biased
    # logits, softmax over those, experts with biases and a clamped SwiGLU (alpha, limit)
    expert_kind: str = "qwen"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    # Gemma 3: each layer's attention window (None: the whole context), the rotary base of
    # the windowed layers, the query scale's denominator (transformers' scaling is
    # query_pre_attn_scalar ** -0.5) and the logits' tanh soft cap, where set
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Ministral 3: queries scaled by 1 + beta * ln(1 + floor(position / original context))
    # after rotary (transformers' get_llama_4_attn_scale); None: not scaled
    query_scaling_beta: float | None = None
    # Qwen3.5: each layer's kind, FULL_ATTENTION or LINEAR_ATTENTION (a Gated DeltaNet of
    # shape `delta_net`, its memory a state per sequence); None: every layer attends
    layer_kinds: tuple[str, ...] | None = None
    delta_net: DeltaNetShape | None = None
    # Qwen3-Next, Qwen3.5-MoE: each sparse layer's shared expert (a SwiGLU this wide, its
    # output scaled by a sigmoid gate of its own) beside the routed ones; 0: none
    shared_expert_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def gemma(self) -> bool:
        """Gemma 3's layer: (1 + w) norms around attention and the feed-forward, GELU,
        embeddings scaled by sqrt(hidden)."""
        return self.model_type == GEMMA3

    @property
    def hybrid(self) -> bool:
        """Linear-attention layers beside full-attention ones (Qwen3.5, Qwen3-Next)."""
        return self.layer_kinds is not None

    @property
    def unit_offset_norms(self) -> bool:
        """Decoder norms that multiply by (1 + w) in float32 (Gemma 3's and the hybrids')."""
        return self.model_type in (GEMMA3, *HYBRID_MODEL_TYPES)

    def layer_kind(self, index: int) -> str:
        """FULL_ATTENTION or LINEAR_ATTENTION: what layer `index` mixes tokens with."""
        return FULL_ATTENTION if self.layer_kinds is None else self.layer_kinds[index]

    def layer_is_linear(self, index: int) -> bool:
        return self.layer_kind(index) == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep K/V, in order: a layer's place in this tuple is the layer
        index `Attention` receives (every layer for the non-hybrid families)."""
        return tuple(i for i in range(self.num_layers) if not self.layer_is_linear(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The linear-attention layers, in order: a layer's place in this tuple is the
        layer index `RecurrentStates` receives (none for the non-hybrid families)."""
        return tuple(i for i in range(self.num_layers) if self.layer_is_linear(i))

    @property
    def kv_layers(self) -> int:
        """Layers a K/V store holds: all of them, or a hybrid model's full-attention ones."""
        return len(self.attention_layers)

    def layer_window(self, index: int) -> int | None:
        """The tokens layer `index` attends to back from each query (itself included);
        None: all of them."""
        return None if self.layer_windows is None else self.layer_windows[index]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each q/k head that rotate (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_is_sparse(self, index: int) -> bool:
        """Whether layer `index` feeds forward through experts (transformers' rule)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    def layer_uses_rope(self, index: int) -> bool:
        return self.rope_layers is None or self.rope_layers[index]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The config of a Hugging Face `config.json` dict."""
        model_type = str(raw.get("model_type", "")).lower()
        if model_type in TEXT_MODEL_OF and isinstance(raw.get("text_config"), dict):
            # Gemma 3 4B and up, Ministral 3, Qwen3.5: a vision model around the text one
            outer = raw
            model_type = TEXT_MODEL_OF[model_type]
            raw = {**raw, **raw["text_config"], "model_type": model_type}
            if model_type in (QWEN35, QWEN35_MOE):  # transformers ties by the outer flag
                raw["tie_word_embeddings"] = bool(outer.get("tie_word_embeddings", False))
        if model_type == GEMMA3:
            raw = {**GEMMA3_TEXT_DEFAULTS, **raw}
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures") or [model_type or "unknown"]
            raise ModelLoadError(
                f"Unsupported architecture {archs[0]!r} (model_type {model_type!r}). kvchat runs "
                f"{SUPPORTED_FAMILIES}. Pick a model of one of those with --model."
            )
        window = None if model_type in (GEMMA3, GPT_OSS) else _sliding_window(raw, model_type)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 writes "rope_parameters" (theta and scaling in one table);
            # older configs have "rope_theta" and "rope_scaling".
            rope = raw.get("rope_parameters") or {}
            theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
            kind = rope.get("rope_type") or rope.get("type")
            scaling = rope if kind not in (None, "default") else raw.get("rope_scaling")
            partial = rope.get(
                "partial_rotary_factor",
                raw.get("partial_rotary_factor", 0.25 if model_type in HYBRID_MODEL_TYPES else 1.0),
            )
            max_positions = int(raw.get("max_position_embeddings", 4096))
            original = rope.get(
                "original_max_position_embeddings", raw.get("original_max_position_embeddings")
            )
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            fields: dict[str, Any] = dict(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                # Qwen3.5-MoE has no dense feed-forward: its config leaves the key out
                intermediate_size=int(raw.get("intermediate_size") or 0)
                if model_type == QWEN35_MOE
                else int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                rope_scaling=_rope_scaling(scaling, max_positions, original),
                qk_norm=model_type in ("qwen3", "qwen3_moe", GEMMA3, *HYBRID_MODEL_TYPES),
                rope_layers=_rope_layers(raw, model_type),
                partial_rotary_factor=float(partial),
                sliding_window=window,
                **_experts(raw, model_type),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
            if model_type == GEMMA3:  # its own rotary per layer type, tied by default
                fields.update(_gemma3(raw))
            if model_type == GPT_OSS:
                fields.update(_gpt_oss(raw))
            if model_type in HYBRID_MODEL_TYPES:
                fields.update(_hybrid(raw))
            beta = rope.get("llama_4_scaling_beta")
            if beta and model_type == "ministral3" and fields["rope_scaling"] is not None:
                fields["query_scaling_beta"] = float(beta)
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"config.json is missing or has a bad value for {exc}; the model folder "
                "looks incomplete. Re-download it or pick another with --model."
            ) from exc

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelLoadError(
                f"{path} is missing: is this a Hugging Face model folder?"
            ) from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path} cannot be read as JSON ({exc}).") from exc
        return cls.from_dict(raw)


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    """The attention window where it takes effect (shorter than the context), else None.

    Qwen2/3 switch it on with use_sliding_window; Mistral and Phi-3 have no switch and
    apply it wherever it is set (Phi-4-mini's, 262,144, is beyond its context)."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    switch = raw.get("use_sliding_window") if model_type in ("qwen2", "qwen3") else True
    if not switch or window >= int(raw.get("max_position_embeddings", 4096)):
        return None
    return window


def _gemma3(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields, as transformers reads them: `layer_types` (else every sixth
    layer global, `sliding_window_pattern`), a rotary table per layer type (transformers
    5's `rope_parameters` by type, or `rope_theta`, `rope_local_base_freq` and a
    `rope_scaling` that applies to the global layers only)."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(
            "This Gemma caps its attention scores (attn_logit_softcapping), as Gemma 2 does; "
            "kvchat runs Gemma 3, which does not. Pick a Gemma 3 model with --model."
        )
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"This Gemma feeds forward through {activation!r}; kvchat runs Gemma 3's "
            "gelu_pytorch_tanh. The config looks edited: re-download the model."
        )
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    windows = _layer_windows({**raw, "layer_types": types}, layers)
    rope = raw.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    scaling = full if full.get("rope_type") not in (None, "default") else raw.get("rope_scaling")
    max_positions = int(raw.get("max_position_embeddings", 131072))
    return {
        "layer_windows": windows,
        "rope_theta": float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        "rope_scaling": _rope_scaling(scaling, max_positions, None),
        "local_rope_theta": float(
            local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
        ),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": (
            float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None
        ),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }


def _hybrid(raw: dict[str, Any]) -> dict[str, Any]:
    """The hybrids' fields (Qwen3.5's, dense or MoE, and Qwen3-Next's), as transformers
    reads them: each layer's kind from `layer_types`, else every
    `full_attention_interval`-th layer (4 by default) full attention and the others
    linear; the linear layers' shape from the `linear_*` keys."""
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:
        interval = int(raw.get("full_attention_interval") or 4)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ModelLoadError(
            f"config.json's layer_types ({len(kinds)} entries for {layers} layers) is not a "
            "list of full_attention and linear_attention; the model folder looks damaged. "
            "Re-download it."
        )
    activation = raw.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(
            f"This model feeds forward through {activation!r}; kvchat runs SiLU. The config "
            "looks edited: re-download the model."
        )
    return {"layer_kinds": tuple(kinds), "delta_net": DeltaNetShape.from_hf(raw)}


def _layer_windows(raw: dict[str, Any], layers: int) -> tuple[int | None, ...] | None:
    """Each layer's window from `layer_types` ("sliding_attention" layers attend within
    `sliding_window`); None when no layer does."""
    types = raw.get("layer_types") or []
    if len(types) != layers:
        raise ModelLoadError(
            f"config.json's layer_types has {len(types)} entries for {layers} layers; the model "
            "folder looks damaged. Re-download it."
        )
    window = raw.get("sliding_window")
    windows = tuple(
        int(window) if kind == "sliding_attention" and window else None for kind in types
    )
    return windows if any(windows) else None


def _gpt_oss(raw: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields: windows on the layers `layer_types` says (every other one by
    transformers' default), sinks, biased routing and the clamped SwiGLU's constants."""
    layers = int(raw["num_hidden_layers"])
    if raw.get("layer_types") is None:
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        raw = {**raw, "layer_types": kinds}
    return {
        "layer_windows": _layer_windows(raw, layers),
        "attention_bias": bool(raw.get("attention_bias", True)),
        "attention_sinks": True,
        "expert_kind": GPT_OSS,
        "moe_intermediate_size": int(raw["intermediate_size"]),
        "norm_topk_prob": True,  # the softmax over the chosen experts sums to 1
        "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
    }


def _experts(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Qwen3-MoE's, Qwen3-Next's, Qwen3.5-MoE's and gpt-oss's expert fields; none for the
    dense families. Qwen3.5-MoE's config has no routing keys: every layer is sparse, the
    chosen experts' weights always renormalized, a shared expert in each (transformers'
    Qwen3_5MoeSparseMoeBlock)."""
    if model_type == GPT_OSS:
        return {
            "num_experts": int(raw.get("num_local_experts") or raw["num_experts"]),
            "num_experts_per_tok": int(
                raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4
            ),
        }
    if model_type not in ("qwen3_moe", QWEN3_NEXT, QWEN35_MOE):
        return {}
    experts = {
        # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts
        "num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
        "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }
    if model_type == QWEN3_NEXT:
        experts["shared_expert_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
    if model_type == QWEN35_MOE:
        experts.update(
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            # transformers' default where the key is left out
            shared_expert_size=int(raw.get("shared_expert_intermediate_size") or 512),
        )
    if not 0 < experts["num_experts_per_tok"] <= experts["num_experts"]:
        raise ModelLoadError(
            f"config.json asks for {experts['num_experts_per_tok']} of "
            f"{experts['num_experts']} experts a token; the model folder looks damaged."
        )
    return experts


def _rope_layers(raw: dict[str, Any], model_type: str) -> tuple[bool, ...] | None:
    """SmolLM3's `no_rope_layers` (1 where a layer rotates, despite the name), or every
    `no_rope_layer_interval`-th layer (4 by default) left without rotary, as transformers
    fills the list in; None for the families that rotate in every layer."""
    if model_type != "smollm3":
        return None
    layers = int(raw["num_hidden_layers"])
    listed = raw.get("no_rope_layers")
    if listed is not None:
        if len(listed) != layers:
            raise ModelLoadError(
                f"config.json's no_rope_layers has {len(listed)} entries for {layers} layers; "
                "the model folder looks damaged. Re-download it."
            )
        return tuple(bool(x) for x in listed)
    interval = int(raw.get("no_rope_layer_interval") or 4)
    return tuple((i + 1) % interval != 0 for i in range(layers))


def _rope_scaling(raw: Any, max_positions: int, original: Any) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind in ("longrope", "su"):
        return _longrope(raw, max_positions, original)
    if kind == "yarn":
        return _yarn(raw, max_positions, original)
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(raw["factor"]))
    raise ModelLoadError(
        f"Unsupported rope scaling {kind!r}; kvchat supports 'llama3', 'linear', 'longrope' "
        "and 'yarn'."
    )


def _longrope(raw: dict[str, Any], max_positions: int, original: Any) -> RopeScaling:
    """Phi-3's LongRoPE as transformers reads it: the attention factor, unless given,
    from the ratio of the context to the original one (sqrt(1 + ln s / ln original))."""
    original = int(raw.get("original_max_position_embeddings") or original or max_positions)
    factor = float(raw.get("factor") or max_positions / original)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        kind="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        short_factor=tuple(float(x) for x in raw["short_factor"]),
        long_factor=tuple(float(x) for x in raw["long_factor"]),
        attention_factor=float(attention),
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times the original (its Eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(raw: dict[str, Any], max_positions: int, original: Any) -> RopeScaling:
    """YaRN as transformers reads it: the factor, unless given, from the two context
    lengths; the attention factor, unless given, from the factor (and `mscale` over
    `mscale_all_dim` where both are set)."""
    original = int(raw.get("original_max_position_embeddings") or original or max_positions)
    factor = float(raw.get("factor") or max_positions / original)
    attention = raw.get("attention_factor")
    if attention is None:
        mscale, all_dims = raw.get("mscale"), raw.get("mscale_all_dim")
        if mscale and all_dims:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims)
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling(
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        beta_fast=float(raw.get("beta_fast") or 32),
        beta_slow=float(raw.get("beta_slow") or 1),
        truncate=bool(raw.get("truncate", True)),
    )
