"""A sparse mixture-of-experts feed-forward (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE,
gpt-oss): a router picks `k` experts a token, each a SwiGLU MLP of its own, and their
outputs are summed by the router's weights.

The two families differ in three places, each a branch here: Qwen3-MoE's router takes a
softmax over every expert, then the top k (renormalized where the config says); gpt-oss's
takes the top k of its biased logits, then a softmax over those. gpt-oss's experts have
biases, and its SwiGLU clamps the gate from above and `up` both ways, then computes
(up + 1) * gate * sigmoid(alpha * gate).

The step's tokens are grouped by expert, so each expert the step needs runs one matrix
product over all its tokens, not one per token: on a CPU a decode of a few sequences
touches a few experts, and a prefill's tokens share them. The router follows
transformers exactly (softmax in float32, top-k, renormalized where the config says,
cast back before the weighting) so logits match within the dtype's tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.errors import ModelLoadError
from kvchat.model.decoder_ops import silu_mul
from kvchat.model.linear import Linear, slot_names


class SparseMoE:
    """The router [E, hidden] and the experts' gate/up [E, 2 I, hidden] and down
    [E, hidden, I] weights, stacked."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor | None,
        down: torch.Tensor | None,
        experts_per_token: int,
        normalize: bool,
        *,
        router_bias: torch.Tensor | None = None,
        gate_up_bias: torch.Tensor | None = None,  # [E, 2 I]
        down_bias: torch.Tensor | None = None,  # [E, hidden]
        clamp: tuple[float, float] | None = None,  # gpt-oss's (alpha, limit)
        linears: list[tuple[Linear, Linear]] | None = None,
    ):
        """Dense experts stacked (`gate_up`, `down`), or each expert's (gate/up, down)
        as built `Linear`s (`linears`: a 4-bit GGUF's, `gguf.weights.expert_linears`)."""
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.k = experts_per_token
        self.normalize = normalize
        self.router_bias = router_bias
        self.gate_up_bias = gate_up_bias
        self.down_bias = down_bias
        self.clamp = clamp
        self.linears = linears
        self.num_experts = len(linears) if linears is not None else int(router.shape[0])

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor], config) -> SparseMoE:
        """From Hugging Face's per-expert names (`mlp.experts.{e}.gate_proj.weight`, ...)
        under `mlp.`, or the experts stacked as transformers holds them (Qwen3.5-MoE's
        files: `mlp.experts.gate_up_proj` [E, 2 I, hidden], gate rows then up rows, and
        `mlp.experts.down_proj` [E, hidden, I], this class's own layout);
        `mlp.gate.weight` is the router. gpt-oss's: `from_gpt_oss`."""
        if config.expert_kind == "gpt_oss":
            return cls.from_gpt_oss(weights, config)
        if "mlp.experts.gate_up_proj" in weights:
            gate_up, down = weights["mlp.experts.gate_up_proj"], weights["mlp.experts.down_proj"]
            e, i, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
            if gate_up.shape != (e, 2 * i, hidden) or down.shape != (e, hidden, i):
                raise ModelLoadError(
                    f"The stacked experts are {tuple(gate_up.shape)} and {tuple(down.shape)} "
                    f"where the config makes {(e, 2 * i, hidden)} and {(e, hidden, i)}; the "
                    "model's files disagree with its config."
                )
            return cls(
                weights["mlp.gate.weight"],
                gate_up,
                down,
                config.num_experts_per_tok,
                config.norm_topk_prob,
            )
        experts = range(config.num_experts)
        built = [
            (
                weights.get(f"mlp.experts.{e}.gate_up_proj"),
                weights.get(f"mlp.experts.{e}.down_proj"),
            )
            for e in experts
        ]
        if all(gate_up is not None and down is not None for gate_up, down in built):
            return cls(
                weights["mlp.gate.weight"],
                None,
                None,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                linears=built,  # type: ignore[arg-type]
            )

        def stacked(*parts: str) -> torch.Tensor:
            return torch.stack(
                [
                    torch.cat([weights[f"mlp.experts.{e}.{p}.weight"] for p in parts])
                    for e in experts
                ]
            )

        return cls(
            weights["mlp.gate.weight"],
            stacked("gate_proj", "up_proj"),
            stacked("down_proj"),
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )

    @classmethod
    def from_gpt_oss(cls, weights: dict[str, torch.Tensor], config) -> SparseMoE:
        """gpt-oss's stacked experts, each with a bias, and `mlp.router` with a bias.

        Hugging Face's files: gate/up [E, hidden, 2 I] with gate and up columns
        interleaved, down [E, I, hidden]. llama.cpp's (`gguf/convert.py`): gate and up
        apart [E, I, hidden], down [E, hidden, I], as linear layers hold them."""
        if "mlp.experts.gate_up_proj" in weights:
            packed = weights["mlp.experts.gate_up_proj"]
            packed_bias = weights["mlp.experts.gate_up_proj_bias"]
            gate_up = torch.cat([packed[..., ::2], packed[..., 1::2]], dim=-1).transpose(1, 2)
            gate_up_bias = torch.cat([packed_bias[:, ::2], packed_bias[:, 1::2]], dim=-1)
            down = weights["mlp.experts.down_proj"].transpose(1, 2)
            down_bias = weights["mlp.experts.down_proj_bias"]
        else:
            part = "mlp.experts.{}_proj.{}".format
            gate_up = torch.cat([weights[part("gate", "weight")], weights[part("up", "weight")]], 1)
            gate_up_bias = torch.cat(
                [weights[part("gate", "bias")], weights[part("up", "bias")]], 1
            )
            down, down_bias = weights[part("down", "weight")], weights[part("down", "bias")]
        return cls(
            weights["mlp.router.weight"],
            gate_up.contiguous(),
            down.contiguous(),
            config.num_experts_per_tok,
            normalize=False,
            router_bias=weights["mlp.router.bias"],
            gate_up_bias=gate_up_bias.contiguous(),
            down_bias=down_bias,
            clamp=(config.swiglu_alpha, config.swiglu_limit),
        )

    def tensors(self) -> list[torch.Tensor]:
        optional = (self.router_bias, self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        built = [
            t
            for pair in self.linears or ()
            for linear in pair
            for t in (getattr(linear, name, None) for name in slot_names(type(linear)))
            if isinstance(t, torch.Tensor)
        ]
        return [self.router, *(t for t in optional if t is not None), *built]

    def nbytes(self) -> int:
        """What one token reads: the router and its k experts (a step of many tokens
        reads more, up to every expert)."""
        expert_bytes = sum(t.nbytes for t in self.tensors()) - self.router.nbytes
        return self.router.nbytes + self.k * expert_bytes // self.num_experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, chosen = self._route(x)  # [T, k]
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs, by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.k
        slot_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            if self.linears is not None:
                gate_up, down = self.linears[expert]
                y = down(self._activation(gate_up(x[rows])))
            else:
                assert self.gate_up is not None and self.down is not None
                h = self._activation(
                    F.linear(x[rows], self.gate_up[expert], self._bias(self.gate_up_bias, expert))
                )
                y = F.linear(h, self.down[expert], self._bias(self.down_bias, expert))
            y = y * slot_weights[start : start + count, None]
            out.index_add_(0, rows, y)
            start += count
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's k experts and their weights, in x's dtype."""
        logits = F.linear(x, self.router, self.router_bias)  # [T, E]
        if self.clamp is not None:  # gpt-oss: top k of the logits, softmax over those
            top, chosen = torch.topk(logits, self.k, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 I] (gate, then up) -> [n, I]."""
        if self.clamp is None:
            return silu_mul(gate_up)
        alpha, limit = self.clamp
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    @staticmethod
    def _bias(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return None if bias is None else bias[expert]
