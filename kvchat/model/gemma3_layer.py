"""Gemma 3's decoder layer, as transformers' Gemma3DecoderLayer computes it.

What it adds to the Llama layer (`transformer.Layer`): every norm multiplies by (1 + w)
in float32 (Gemma's RMSNorm), attention and the feed-forward are each normalized before
and after (the output norm applied before the residual add), q and k are normalized per
head, queries are scaled by `query_pre_attn_scalar` ** -0.5 rather than head_dim ** -0.5,
the feed-forward is GELU (tanh) of the gate times up, and five layers of six attend within
a window, with a rotary base of their own (the caller hands each layer its cos/sin).

The norms round as transformers' do (the (1 + w) factor applied in float32, one rounding
to the dtype), which differs from Llama's in bf16: they have fused kernels of their own
(`decoder_ops.gemma_*`), so that a decode step's six norms, two residual adds and GELU are
four calls a layer rather than about fifty torch ops.
"""

from __future__ import annotations

import torch

from kvchat.model.batch import Attention
from kvchat.model.config import ModelConfig
from kvchat.model.decoder_ops import (
    gelu_tanh_mul,
    gemma_add_norm,
    gemma_heads_norm_,
    gemma_norm,
    rotate_,
)
from kvchat.model.linear import Linear, make_linear


def gemma_multiplier(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's weight w as the float32 factor (1 + w) it multiplies by."""
    return 1.0 + weight.float()


class Gemma3Layer:
    """One Gemma 3 decoder layer's weights (q/k/v and gate/up fused) and its forward."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int):
        self.config = config
        self.window = config.layer_window(index)
        self.rotates = True
        self.experts = None  # Gemma 3 has no experts nor sinks (the Transformer asks)
        self.sinks = None
        norm = {
            name: gemma_multiplier(weights[f"{name}.weight"])
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "self_attn.q_norm",
                "self_attn.k_norm",
            )
        }
        self.input_norm = norm["input_layernorm"]
        self.post_attention_norm = norm["post_attention_layernorm"]
        self.pre_feedforward_norm = norm["pre_feedforward_layernorm"]
        self.post_feedforward_norm = norm["post_feedforward_layernorm"]
        self.q_norm = norm["self_attn.q_norm"]
        self.k_norm = norm["self_attn.k_norm"]
        qkv = ("q", "k", "v")
        self.qkv: Linear = weights.get("self_attn.qkv_proj") or make_linear(
            [weights[f"self_attn.{p}_proj.weight"] for p in qkv],
            [weights[f"self_attn.{p}_proj.bias"] for p in qkv] if config.attention_bias else None,
        )
        self.o: Linear = make_linear([weights["self_attn.o_proj.weight"]])
        self.gate_up: Linear | None = weights.get("mlp.gate_up_proj") or make_linear(
            [weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]]
        )
        self.down: Linear | None = make_linear([weights["mlp.down_proj.weight"]])
        # the attention scales by head_dim ** -0.5: the queries carry the rest
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.query_factor = (config.head_dim / scalar) ** 0.5 if scalar != config.head_dim else None

    def forward(
        self,
        index: int,
        h: torch.Tensor,  # [T, hidden]: the residual stream
        pending: torch.Tensor | None,  # [T, hidden]: the previous layer's feed-forward output
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's normalized feed-forward output, not yet added)."""
        c = self.config
        eps = c.rms_norm_eps
        if pending is None:
            x = gemma_norm(h, self.input_norm, eps)
        else:
            h, x = gemma_add_norm(h, pending, None, self.input_norm, eps)
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
        t = qkv.shape[0]
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        gemma_heads_norm_(qkv, self.q_norm, self.k_norm, c.num_heads, c.num_kv_heads, eps)
        rotate_(qkv, cos, sin, c.num_heads + c.num_kv_heads)  # q and k, in place
        if self.query_factor is not None:
            q.mul_(self.query_factor)
        if self.window is None:
            attn = attention(index, q, k, v)  # [T, Hq, D]
        else:
            attn = attention(index, q, k, v, window=self.window)
        out = self.o(attn.reshape(t, c.q_size))
        h, x = gemma_add_norm(h, out, self.post_attention_norm, self.pre_feedforward_norm, eps)
        mlp = self.down(gelu_tanh_mul(self.gate_up(x)))  # type: ignore[misc]
        return h, gemma_norm(mlp, self.post_feedforward_norm, eps)
