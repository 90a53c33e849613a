"""The Llama-family forward pass in plain torch (and Qwen3's q/k norms, SmolLM3's
layers without rotary, Phi-3's partial rotary and Qwen3-MoE's experts, `Layer`; Gemma 3's
layer is `gemma3_layer.Gemma3Layer`, its windowed layers rotated by a table of their own;
Qwen3.5's is `qwen35_layer.Qwen35Layer`, its linear-attention layers carrying each
sequence's state from one forward to the next through `RecurrentStates`).

Written to be checked against the paper and transformers' LlamaModel line by line;
the differences are for speed only: q/k/v and gate/up are fused into one matmul
each, rotary cos/sin are gathered once per forward, the small ops between the
matmuls run fused where kvchat's kernels are loaded (`decoder_ops`), and logits
are computed only for the positions the caller asks for. Norms follow transformers
exactly (float32 variance, cast back before the weight) so logits match within the
dtype's tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvchat.errors import ModelLoadError
from kvchat.model import huge_pages
from kvchat.model.batch import Attention, ForwardBatch, FreshStates, RecurrentStates
from kvchat.model.config import ModelConfig
from kvchat.model.decoder_ops import (
    add_rms_norm,
    gemma_add_norm,
    rms_norm_reference,
    rotary_reference,
    rotate_,
    silu_mul,
)
from kvchat.model.gemma3_layer import Gemma3Layer, gemma_multiplier
from kvchat.model.linear import (
    Linear,
    StackedLinear,
    bounded_kernel_caches,
    make_linear,
    slot_names,
)
from kvchat.model.quantized_linear import Q8Linear
from kvchat.model.qwen35_layer import Qwen35Layer
from kvchat.model.read_ahead import read_ahead
from kvchat.model.rope import RotaryTable, longrope_set
from kvchat.model.sparse_moe import SparseMoE


class Layer:
    """One decoder layer's weights (fused) and its forward."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int = 0):
        self.config = config
        self.rotates = config.layer_uses_rope(index)
        self.input_norm = weights["input_layernorm.weight"]
        self.post_norm = weights["post_attention_layernorm.weight"]
        # Qwen3: each head of q and k normalized (one weight of head_dim) before rotary
        self.q_norm = weights["self_attn.q_norm.weight"] if config.qk_norm else None
        self.k_norm = weights["self_attn.k_norm.weight"] if config.qk_norm else None
        qkv = ("q", "k", "v")
        # A loader may hand over pre-built (e.g. 4-bit) fused projections under these names.
        self.qkv: Linear = weights.get("self_attn.qkv_proj") or make_linear(
            [weights[f"self_attn.{p}_proj.weight"] for p in qkv],
            [weights[f"self_attn.{p}_proj.bias"] for p in qkv] if config.attention_bias else None,
        )  # [(Hq + 2 Hkv) D, hidden]
        o_bias = weights.get("self_attn.o_proj.bias")  # gpt-oss's
        self.o: Linear = make_linear(
            [weights["self_attn.o_proj.weight"]], [o_bias] if o_bias is not None else None
        )
        # gpt-oss: a learned logit per query head joins its softmax; every other layer
        # attends within a window
        self.sinks = weights.get("self_attn.sinks") if config.attention_sinks else None
        self.window = config.layer_window(index)
        # Qwen3-MoE's and gpt-oss's sparse layers: experts in place of the one MLP
        self.experts = (
            SparseMoE.from_weights(weights, config) if config.layer_is_sparse(index) else None
        )
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        if self.experts is None:
            self.gate_up = weights.get("mlp.gate_up_proj") or make_linear(
                [weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]]
            )  # [2 I, hidden]
            self.down = make_linear([weights["mlp.down_proj.weight"]])

    def forward(
        self,
        index: int,
        h: torch.Tensor,  # [T, hidden]: the residual stream
        pending: torch.Tensor | None,  # [T, hidden]: the previous layer's MLP output, not yet added
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
        query_scale: torch.Tensor | None = None,  # [T, 1, 1]: Ministral 3's, by position
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output): the caller adds the latter, fused
        with the next norm (`add_rms_norm`), so no layer pays a separate add."""
        c = self.config
        h, x = add_rms_norm(h, pending, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
        t = qkv.shape[0]
        if self.q_norm is not None:
            self._norm_heads(qkv, t)
        if self.rotates and c.rotary_dim == c.head_dim:
            rotate_(qkv, cos, sin, c.num_heads + c.num_kv_heads)  # q and k, in place, in one op
        elif self.rotates:  # Phi-3: the leading rotary_dim of each head, the rest as it is
            part = qkv[:, : c.q_size + c.kv_size].view(t, -1, c.head_dim)[..., : c.rotary_dim]
            part.copy_(rotary_reference(part, cos.unsqueeze(1), sin.unsqueeze(1)))
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        if query_scale is not None:
            q.mul_(query_scale)
        if self.sinks is None and self.window is None:
            attn = attention(index, q, k, v)  # [T, Hq, D]
        else:
            attn = attention(index, q, k, v, window=self.window, sinks=self.sinks)
        h, x = add_rms_norm(h, self.o(attn.reshape(t, c.q_size)), self.post_norm, c.rms_norm_eps)
        if self.experts is not None:
            return h, self.experts(x)
        return h, self.down(silu_mul(self.gate_up(x)))  # type: ignore[misc]

    def _norm_heads(self, qkv: torch.Tensor, t: int) -> None:
        """Qwen3's q_norm and k_norm, in place in the fused projection's rows: transformers'
        RMSNorm over the head dimension of every head."""
        c = self.config
        q = qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        q.copy_(rms_norm_reference(q, self.q_norm, c.rms_norm_eps))
        k.copy_(rms_norm_reference(k, self.k_norm, c.rms_norm_eps))


class Transformer:
    """Embeddings, decoder layers, final norm and the LM head, on one device and dtype."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        max_positions: int | None = None,
    ):
        self.config = config
        missing = _missing_weights(config, weights)
        if missing:
            raise ModelLoadError(
                f"The model's weights are incomplete: {len(missing)} tensors missing "
                f"(e.g. {missing[0]}). Re-download or re-convert the model."
            )
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head: Linear = weights.get("lm_head") or make_linear(
            [weights.get("lm_head.weight", self.embed)]
        )
        # A tied head kept at 8 bits (a GGUF's token_embd) is the embedding table too:
        # rows are looked up in its codes, and the dense table (mapped from the converted
        # file) is never read, so never resident.
        tied = isinstance(self.lm_head, Q8Linear) and "lm_head.weight" not in weights
        self.embed_codes = self.lm_head if tied else None
        self.norm = weights["model.norm.weight"]
        if config.unit_offset_norms:  # (1 + w), float32
            self.norm = gemma_multiplier(self.norm)
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        layer_kind = Gemma3Layer if config.gemma else Qwen35Layer if config.hybrid else Layer
        self.layers: list[Layer | Gemma3Layer | Qwen35Layer] = [
            layer_kind(config, _strip_prefix(weights, f"model.layers.{i}."), i)
            for i in range(config.num_layers)
        ]
        linears = self._linears()
        with bounded_kernel_caches(linears):  # the first packing builds the first kernel
            for linear in linears:
                linear.prepack()  # after the loader cached any quantized layers (see `Linear`)
        if self.device.type == "cpu":
            self._gather_into_huge_pages()
            if self.embed_codes is None:
                read_ahead(self.embed)  # where it is mapped from a file: see `read_ahead`
        self.max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryTable(config, self.max_positions, self.dtype, self.device)
        self.rotary_set = longrope_set(config, self.max_positions)
        # Gemma 3's windowed layers: a rotary base of their own, never scaled
        self.local_rotary = (
            RotaryTable(
                replace(config, rope_theta=config.local_rope_theta, rope_scaling=None),
                self.max_positions,
                self.dtype,
                self.device,
            )
            if config.local_rope_theta is not None
            else None
        )

    def fit_context(self, context: int) -> str | None:
        """Rotary for a context of `context` tokens: LongRoPE's frequencies depend on it
        (`rope.longrope_set`); the others do not. Returns the set in use (None for one
        set), which keys computed with it must be told apart by."""
        chosen = longrope_set(self.config, context)
        if chosen != self.rotary_set:
            self.rotary = RotaryTable(
                self.config, self.max_positions, self.dtype, self.device, context=context
            )
            self.rotary_set = chosen
        return chosen

    def _query_scale(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's query scale [T, 1, 1] by position: 1 up to the original context,
        growing by beta * ln 2, ln 3, ... each original context further (None elsewhere)."""
        beta, scaling = self.config.query_scaling_beta, self.config.rope_scaling
        if beta is None or scaling is None:
            return None
        steps = torch.floor(positions / scaling.original_max_position_embeddings)
        return (1 + beta * torch.log(1 + steps)).to(self.dtype)[:, None, None]

    def _gather_into_huge_pages(self) -> None:
        """Every linear layer's tensors, copied into one arena of 2 MiB pages: a decode
        step streams them all (`huge_pages` says why). The embedding table is left where
        it is: a step reads one row of it a token."""
        places: list[tuple[object, str]] = []
        for linear in self._linears():
            for name in slot_names(type(linear)):
                t = getattr(linear, name, None)
                if (
                    isinstance(t, torch.Tensor)
                    and t.layout == torch.strided
                    and t.is_contiguous()
                    and t.data_ptr() != self.embed.data_ptr()  # a tied head stays shared
                ):
                    places.append((linear, name))
        huge_pages.move_into_arena(places)

    def weight_bytes(self) -> int:
        """Bytes of memory the weights hold (each storage once: a tied head, the huge-page
        arena's views and a layer's dense copy are counted as what they occupy)."""
        tensors = [self.norm, *self.rotary_tensors()]
        if self.embed_codes is None:  # else the head's codes, counted with the head
            tensors.append(self.embed)
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
            if layer.experts is not None:
                tensors += layer.experts.tensors()
            delta_net = getattr(layer, "delta_net", None)  # Qwen3.5's linear layers
            if delta_net is not None:
                tensors += [t for t in vars(delta_net).values() if isinstance(t, torch.Tensor)]
        for linear in self._linears():
            for name in slot_names(type(linear)):
                t = getattr(linear, name, None)
                if isinstance(t, torch.Tensor):
                    tensors.append(t)
        storages: dict[int, int] = {}
        for t in tensors:
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # opaque (oneDNN-packed) tensors
                storages[id(t)] = t.numel() * t.element_size()
                continue
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def rotary_tensors(self) -> list[torch.Tensor]:
        tables = [self.rotary] if self.local_rotary is None else [self.rotary, self.local_rotary]
        return [t for table in tables for t in vars(table).values() if isinstance(t, torch.Tensor)]

    def _linears(self) -> list[Linear]:
        """Every linear layer, a stacked one as its parts: what holds the tensors (the
        huge-page arena, the weight count) and what oneDNN packs are the parts (a Q4_K_M
        file's q/k/v is 4-bit q and k beside a Q6_K v)."""
        layers = [
            (layer.qkv, layer.o, layer.gate_up, layer.down, *_hybrid_linears(layer))
            for layer in self.layers
        ]
        linears = [self.lm_head, *(linear for group in layers for linear in group if linear)]
        return [
            part
            for linear in linears
            for part in (linear.parts if isinstance(linear, StackedLinear) else (linear,))
        ]

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        attention: Attention,
        states: RecurrentStates | None = None,
    ) -> torch.Tensor:
        """Logits [N, vocab] in float32 for `batch.logits_indices`.

        A hybrid model's linear-attention layers read and write each run's state in
        `states` (None: every run from zeros, a whole prompt); the others ignore it."""
        c = self.config
        if self.embed_codes is not None:
            h = self.embed_codes.rows(batch.input_ids).to(self.dtype)  # [T, hidden]
        else:
            h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        if c.gemma:  # scaled by sqrt(hidden), the factor rounded to the dtype first
            h = h * torch.tensor(c.hidden_size**0.5, dtype=h.dtype)
        cos, sin = self.rotary.lookup(batch.positions)
        local = self.local_rotary.lookup(batch.positions) if self.local_rotary else (cos, sin)
        query_scale = self._query_scale(batch.positions)
        pending = None
        if c.hybrid:
            states = FreshStates() if states is None else states
            for layer in self.layers:
                h, pending = layer.forward(  # type: ignore[call-arg]
                    h, pending, cos, sin, attention, batch.query_lens, states
                )
            return self._logits(h, pending, batch.logits_indices)
        for i, layer in enumerate(self.layers):
            rotary = local if c.layer_window(i) is not None else (cos, sin)
            if query_scale is None:
                h, pending = layer.forward(i, h, pending, *rotary, attention)
            else:
                h, pending = layer.forward(i, h, pending, *rotary, attention, query_scale)
        return self._logits(h, pending, batch.logits_indices)

    def _logits(self, h: torch.Tensor, pending: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head, only at `rows` (where logits are needed)."""
        c = self.config
        if c.unit_offset_norms:
            _, h = gemma_add_norm(h[rows], pending[rows], None, self.norm, c.rms_norm_eps)
        else:
            _, h = add_rms_norm(h[rows], pending[rows], self.norm, c.rms_norm_eps)
        logits = self.lm_head(h).float()  # [N, vocab]
        if c.final_logit_softcapping is not None:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def _hybrid_linears(layer: object) -> tuple[Linear, ...]:
    """A Qwen3.5 / Qwen3-Next layer's projections besides the four every layer has."""
    delta_net = getattr(layer, "delta_net", None)
    found = () if delta_net is None else (delta_net.in_proj, delta_net.out_proj)
    shared_gate = getattr(layer, "shared_gate", None)
    return found if shared_gate is None else (*found, shared_gate)


def _strip_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


FILE_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
}


def split_fused_weights(config: ModelConfig, weights: dict) -> dict:
    """Phi-3's files hold q/k/v and gate/up as one matrix each: split into the names
    every other family uses (views, no copy), so quantizing, loading and fusing again
    have one path."""
    sizes = {
        "self_attn.qkv_proj.weight": (config.q_size, config.kv_size, config.kv_size),
        "mlp.gate_up_proj.weight": (config.intermediate_size,) * 2,
    }
    out = dict(weights)
    for name, tensor in weights.items():
        local = name.rpartition("layers.")[2].partition(".")[2]
        if local not in FILE_FUSED or not isinstance(tensor, torch.Tensor):
            continue
        if tensor.shape[0] != sum(sizes[local]):
            raise ModelLoadError(
                f"{name} has {tensor.shape[0]} rows where the config makes "
                f"{sum(sizes[local])}; the model's files disagree with its config."
            )
        prefix = name[: -len(local)]
        for part, piece in zip(FILE_FUSED[local], tensor.split(sizes[local]), strict=True):
            out[f"{prefix}{part}.weight"] = piece
        del out[name]
    return out


def _missing_weights(config: ModelConfig, weights: dict) -> list[str]:
    names: list[str] = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    attention: Iterable[str] = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
    )
    if config.qk_norm:
        attention = (*attention, "self_attn.q_norm.weight", "self_attn.k_norm.weight")
    if config.attention_sinks:
        attention = (*attention, "self_attn.sinks")
    dense = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
    experts: tuple[str, ...] = (
        "mlp.gate.weight",
        *(
            f"mlp.experts.{e}.{p}.weight"
            for e in range(config.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ),
    )
    if config.expert_kind == "gpt_oss":  # stacked, with biases (llama.cpp's names: gate, up)
        packed = not any(name.endswith("mlp.experts.gate_proj.weight") for name in weights)
        stacked = (
            (f"{p}{b}" for p in ("gate_up_proj", "down_proj") for b in ("", "_bias"))
            if packed
            else (f"{p}_proj.{k}" for p in ("gate", "up", "down") for k in ("weight", "bias"))
        )
        experts = ("mlp.router.weight", "mlp.router.bias", *(f"mlp.experts.{n}" for n in stacked))
    if config.expert_kind != "gpt_oss" and any(
        name.endswith("mlp.experts.gate_up_proj") for name in weights
    ):  # stacked, as Qwen3.5-MoE's files hold them (`SparseMoE.from_weights`)
        experts = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    if config.shared_expert_size:  # Qwen3-Next's, Qwen3.5-MoE's
        experts = (
            *experts,
            "mlp.shared_expert_gate.weight",
            *(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")),
        )
    # Qwen3-Next fuses q/k/v/z and b/a (`gated_deltanet.split_qwen3_next`)
    projections = ("qkvz", "ba") if config.model_type == "qwen3_next" else ("qkv", "z", "b", "a")
    linear = (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"linear_attn.in_proj_{p}.weight" for p in projections),
        *(f"linear_attn.{n}" for n in ("conv1d.weight", "dt_bias", "A_log", "norm.weight")),
        "linear_attn.out_proj.weight",
    )
    for i in range(config.num_layers):
        feed_forward = experts if config.layer_is_sparse(i) else dense
        mixer = linear if config.layer_is_linear(i) else attention
        names.extend(f"model.layers.{i}.{n}" for n in (*mixer, *feed_forward))
    fused = {
        "self_attn.q_proj.weight": "self_attn.qkv_proj",
        "self_attn.k_proj.weight": "self_attn.qkv_proj",
        "self_attn.v_proj.weight": "self_attn.qkv_proj",
        "mlp.gate_proj.weight": "mlp.gate_up_proj",
        "mlp.up_proj.weight": "mlp.gate_up_proj",
    }

    def present(name: str) -> bool:
        if name in weights:
            return True
        if name == "lm_head.weight":
            return "lm_head" in weights
        prefix, _, rest = name.rpartition("layers.")
        index, _, local = rest.partition(".")
        return local in fused and f"{prefix}layers.{index}.{fused[local]}" in weights

    return [n for n in names if not present(n)]
