"""Qwen3.5's decoder layer (dense), as transformers' Qwen3_5DecoderLayer computes it,
and Qwen3-Next's (Qwen3NextDecoderLayer) and Qwen3.5-MoE's (Qwen3_5MoeDecoderLayer), the
same with sparse feed-forward layers.

Three layers in four (by default) mix tokens through a Gated DeltaNet
(`gated_deltanet`): its memory of a sequence is one fixed-size state, read and written
per sequence through `RecurrentStates`, never K/V. The others attend, with what Qwen3's
attention does (q/k normalized per head) and three changes: q_proj gives each head a
gate beside its query ([q | gate], head by head), the attention's output is multiplied
by sigmoid(gate) before o_proj; only the leading quarter of each head rotates
(`partial_rotary_factor`; Qwen3.5's multimodal rotary is plain rotary for text, every
position stream being the token's position). Every decoder norm multiplies by (1 + w) in
float32, as Gemma's do (`decoder_ops.gemma_norm`); the feed-forward is SwiGLU, or in the sparse
layers (Qwen3-Next's, every one of Qwen3.5-MoE's) Qwen3-MoE's routed experts
(`SparseMoE`) plus a shared SwiGLU expert whose output is scaled by sigmoid of a gate of
its own.

A layer knows its place among the layers of its kind (`ordinal`): the K/V store holds
only the attention layers, the engine's states only the linear ones.
"""

from __future__ import annotations

import torch

from kvchat.model.batch import Attention, RecurrentStates
from kvchat.model.config import ModelConfig
from kvchat.model.decoder_ops import gemma_norm, rotary_reference, silu_mul
from kvchat.model.gated_deltanet import GatedDeltaNet
from kvchat.model.gemma3_layer import gemma_multiplier
from kvchat.model.linear import Linear, make_linear
from kvchat.model.sparse_moe import SparseMoE


class Qwen35Layer:
    """One Qwen3.5 decoder layer's weights (projections fused) and its forward."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int):
        self.config = config
        self.linear = config.layer_is_linear(index)
        # the layer's place among its kind: the KV store's layer index, or the states'
        kind = config.layer_kind(index)
        self.ordinal = sum(1 for i in range(index) if config.layer_kind(i) == kind)
        self.sinks = None  # no sinks, no window (the Transformer asks)
        self.window = None
        self.input_norm = gemma_multiplier(weights["input_layernorm.weight"])
        self.post_norm = gemma_multiplier(weights["post_attention_layernorm.weight"])
        self.delta_net: GatedDeltaNet | None = None
        self.qkv: Linear | None = None
        self.o: Linear | None = None
        if self.linear:
            assert config.delta_net is not None  # set with layer_kinds by the config
            self.delta_net = GatedDeltaNet(config.delta_net, weights)
        else:
            self.q_norm = gemma_multiplier(weights["self_attn.q_norm.weight"])
            self.k_norm = gemma_multiplier(weights["self_attn.k_norm.weight"])
            parts = ("q", "k", "v")
            self.qkv = weights.get("self_attn.qkv_proj") or make_linear(
                [weights[f"self_attn.{p}_proj.weight"] for p in parts],
                [weights[f"self_attn.{p}_proj.bias"] for p in parts]
                if config.attention_bias
                else None,
            )  # [2 Hq D + 2 Hkv D, hidden]: per query head its q then its gate; k; v
            o_bias = weights.get("self_attn.o_proj.bias")
            self.o = make_linear(
                [weights["self_attn.o_proj.weight"]], [o_bias] if o_bias is not None else None
            )
        # Qwen3-Next's and Qwen3.5-MoE's sparse layers: routed experts, and a shared one
        # (gate_up, down) whose output is scaled by sigmoid(shared_gate(x))
        self.experts = (
            SparseMoE.from_weights(weights, config) if config.layer_is_sparse(index) else None
        )
        self.shared_gate: Linear | None = None
        mlp = "mlp."
        if self.experts is not None and config.shared_expert_size:
            mlp = "mlp.shared_expert."
            self.shared_gate = make_linear(
                [weights["mlp.shared_expert_gate.weight"]]
            )  # [1, hidden]
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        if self.experts is None or self.shared_gate is not None:
            self.gate_up = weights.get(f"{mlp}gate_up_proj") or make_linear(
                [weights[f"{mlp}gate_proj.weight"], weights[f"{mlp}up_proj.weight"]]
            )  # [2 I, hidden]
            self.down = make_linear([weights[f"{mlp}down_proj.weight"]])

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the residual stream
        pending: torch.Tensor | None,  # [T, hidden]: the previous layer's MLP output
        cos: torch.Tensor,  # [T, rotary_dim]
        sin: torch.Tensor,
        attention: Attention,
        query_lens: tuple[int, ...],
        states: RecurrentStates,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output, not yet added)."""
        eps = self.config.rms_norm_eps
        if pending is not None:
            h = h + pending
        x = gemma_norm(h, self.input_norm, eps)
        if self.linear:
            h = h + self._linear_attention(x, query_lens, states)
        else:
            h = h + self._attention(x, cos, sin, attention)
        x = gemma_norm(h, self.post_norm, eps)
        return h, self._feed_forward(x)

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU; or the routed experts, plus the shared expert scaled by its gate."""
        if self.experts is None:
            return self.down(silu_mul(self.gate_up(x)))  # type: ignore[misc]
        routed = self.experts(x)
        if self.shared_gate is None:
            return routed
        shared = self.down(silu_mul(self.gate_up(x)))  # type: ignore[misc]
        return routed + torch.sigmoid(self.shared_gate(x)) * shared

    def _linear_attention(
        self, x: torch.Tensor, query_lens: tuple[int, ...], states: RecurrentStates
    ) -> torch.Tensor:
        """The Gated DeltaNet over each run of the batch in turn, each from its own state."""
        delta_net = self.delta_net
        assert delta_net is not None
        outs = []
        for run, part in enumerate(x.split(list(query_lens))):
            state = states.state(self.ordinal, run)
            if state is None:
                state = delta_net.zero_state(x.device)
            keep_at = states.keep_at(run)
            out, state, kept = delta_net.forward_keeping(part, state, keep_at)
            states.update(self.ordinal, run, state)
            for offset, state_there in zip(keep_at, kept, strict=True):
                states.keep(self.ordinal, run, offset, state_there)
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Gated attention: q/k normalized per head, their leading `rotary_dim` rotated,
        the output times sigmoid(gate) before o_proj."""
        c = self.config
        eps, dim, t = c.rms_norm_eps, c.head_dim, x.shape[0]
        qkv = self.qkv(x)  # type: ignore[misc]  # [T, 2 Hq D + 2 Hkv D]
        q_gate = qkv[:, : 2 * c.q_size].view(t, c.num_heads, 2 * dim)
        gate = q_gate[..., dim:]  # [T, Hq, D]
        q = gemma_norm(q_gate[..., :dim], self.q_norm, eps)  # [T, Hq, D], a new tensor
        k = qkv[:, 2 * c.q_size : 2 * c.q_size + c.kv_size].view(t, c.num_kv_heads, dim)
        k = gemma_norm(k, self.k_norm, eps)
        v = qkv[:, 2 * c.q_size + c.kv_size :].view(t, c.num_kv_heads, dim)
        r = c.rotary_dim
        for y in (q, k):
            part = y[..., :r]
            part.copy_(rotary_reference(part, cos.unsqueeze(1), sin.unsqueeze(1)))
        attn = attention(self.ordinal, q, k, v)  # [T, Hq, D]
        return self.o(  # type: ignore[misc]
            (attn * torch.sigmoid(gate)).reshape(t, c.q_size)
        )
