"""The transformer's shape, read from a Hugging Face `config.json` dict.

One dataclass for the Llama family and the families that add a step to it: Llama
2/3.x, Mistral, Qwen2/2.5 and SmolLM2 differ only in values (q/k/v bias, rope scaling,
tied embeddings); Qwen3 adds a per-head RMSNorm of q and k before rotary (`qk_norm`);
SmolLM3 leaves rotary out of every fourth layer (`rope_layers`).
Anything else is refused here, with a message, before any weight is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
SUPPORTED_FAMILIES = "Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (dense), SmolLM2, SmolLM3, TinyLlama"


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x's frequency-dependent rope scaling ("llama3"), or "linear"."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_uses_rope(self, index: int) -> bool:
        return self.rope_layers is None or self.rope_layers[index]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = str(raw.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures") or [model_type or "unknown"]
            raise ModelLoadError(
                f"Unsupported architecture {archs[0]!r} (model_type {model_type!r}). kvchat runs "
                f"{SUPPORTED_FAMILIES}. Pick a model of one of those with --model."
            )
        if raw.get("use_sliding_window") and raw.get("sliding_window"):
            raise ModelLoadError(
                f"This {model_type} model uses sliding-window attention (use_sliding_window), "
                "which kvchat does not run yet; pick a model without it."
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 writes "rope_parameters" (theta and scaling in one table);
            # older configs have "rope_theta" and "rope_scaling".
            rope = raw.get("rope_parameters") or {}
            theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
            scaling = (
                rope if rope.get("rope_type") not in (None, "default") else raw.get("rope_scaling")
            )
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                rope_scaling=_rope_scaling(scaling),
                qk_norm=model_type == "qwen3",
                rope_layers=_rope_layers(raw, model_type),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
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


def _rope_scaling(raw: Any) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
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
        f"Unsupported rope scaling {kind!r}; kvchat supports 'llama3' and 'linear'."
    )
