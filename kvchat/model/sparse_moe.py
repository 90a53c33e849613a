"""A sparse mixture-of-experts feed-forward (Qwen3-MoE): a router picks `k` experts a
token, each a SwiGLU MLP of its own, and their outputs are summed by the router's weights.

The step's tokens are grouped by expert, so each expert the step needs runs one matrix
product over all its tokens, not one per token: on a CPU a decode of a few sequences
touches a few experts, and a prefill's tokens share them. The router follows
transformers exactly (softmax in float32, top-k, renormalized where the config says,
cast back before the weighting) so logits match within the dtype's tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvchat.model.decoder_ops import silu_mul


class SparseMoE:
    """The router [E, hidden] and the experts' gate/up [E, 2 I, hidden] and down
    [E, hidden, I] weights, stacked."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        experts_per_token: int,
        normalize: bool,
    ):
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.k = experts_per_token
        self.normalize = normalize

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor], config) -> SparseMoE:
        """From Hugging Face's per-expert names (`mlp.experts.{e}.gate_proj.weight`, ...)
        under `mlp.`; `mlp.gate.weight` is the router."""
        experts = range(config.num_experts)

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

    def tensors(self) -> list[torch.Tensor]:
        return [self.router, self.gate_up, self.down]

    def nbytes(self) -> int:
        """What one token reads: the router and its k experts (a step of many tokens
        reads more, up to every expert)."""
        experts = self.gate_up.shape[0]
        per_expert = (self.gate_up.nbytes + self.down.nbytes) // experts
        return self.router.nbytes + self.k * per_expert

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.k, dim=-1)  # [T, k]
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs, by expert
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        tokens = order // self.k
        slot_weights = weights.flatten()[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            h = silu_mul(F.linear(x[rows], self.gate_up[expert]))
            y = F.linear(h, self.down[expert]) * slot_weights[start : start + count, None]
            out.index_add_(0, rows, y)
            start += count
        return out
