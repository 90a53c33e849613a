"""Qwen3.5's and Qwen3-Next's linear-attention layer (Gated DeltaNet), one sequence at a
time, its memory of the past held in an explicit state (`DeltaNetState`) rather than in
K/V pages.

Where a full-attention layer reads every earlier token's keys and values, this layer
keeps two fixed-size tensors a sequence, whatever its length: the last few inputs of a
short causal convolution, and a matrix per value head that the gated delta rule
(Yang et al., "Gated Delta Networks", 2024) rewrites at each token:

    S <- exp(g) S                        decay, g = -exp(A_log) * softplus(a + dt_bias)
    S <- S + k (beta (v - k^T S))^T      the delta rule: write only what S mispredicts
    o  = q^T S                           q and k L2-normalized, q scaled by Dk ** -0.5

so a prompt may be prefilled in several calls and then decoded a token a call, each call
starting from the state the last one returned. A prefill computes the same recurrence a
chunk of 64 tokens at a time (`chunk_rule`): within a chunk it is a few matrix products
and two triangular solves (the "UT transform"), and only the chunks run in sequence.
Decode steps the recurrence once (`recurrent_rule`).

Written to be checked against transformers' Qwen3_5GatedDeltaNet line by line: the same
casts (the convolution in the activation dtype, the rule in float32, the recurrent state
kept in float32 in every dtype), the same chunk size, the same gated norm. The
differences: the four input projections run as one fused matmul, and the convolution
state keeps the K - 1 inputs the next call reads (transformers keeps K, the oldest never
read).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvchat.errors import ModelLoadError
from kvchat.model.config import DeltaNetShape
from kvchat.model.linear import Linear, make_linear

CHUNK = 64  # transformers' and flash-linear-attention's chunk size (matching it matches rounding)


@dataclass(frozen=True)
class DeltaNetState:
    """What one sequence carries from one call of a layer to the next.

    `conv` [K - 1, conv_dim]: the layer's last K - 1 convolution inputs (q/k/v before
    the convolution), oldest first, in the activation dtype; zeros before the first
    token, as the convolution pads. `recurrent` [Hv, Dk, Dv]: the delta rule's matrix
    per value head, float32 whatever the activation dtype (transformers keeps it so;
    rounding it each token would drift over a long decode).

    Both are the same size at every length: for transformers' default shape (Hk 16,
    Hv 32, Dk = Dv = 128, K 4) a sequence holds 2 MiB of recurrent state and, in bf16,
    48 KiB of convolution state a layer."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(
        cls, shape: DeltaNetShape, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> DeltaNetState:
        """The state before a sequence's first token."""
        return cls(
            conv=torch.zeros(shape.conv_kernel - 1, shape.conv_dim, dtype=dtype, device=device),
            recurrent=torch.zeros(
                shape.num_v_heads,
                shape.head_k_dim,
                shape.head_v_dim,
                dtype=torch.float32,
                device=device,
            ),
        )


def split_qwen3_next(
    shape: DeltaNetShape, qkvz: torch.Tensor, ba: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-Next's fused `in_proj_qkvz` and `in_proj_ba` as Qwen3.5's four projections.

    Qwen3-Next groups the rows by key head: for each, its q, k, then the v and z of the
    value heads it serves, and (in `ba`) their b then a. Qwen3.5 keeps q, k and v of all
    heads in turn (the order the convolution's channels take), then z, b and a apart."""
    s = shape
    per_group = s.num_v_heads // s.num_k_heads
    hidden = qkvz.shape[-1]
    groups = qkvz.view(s.num_k_heads, -1, hidden)
    q, k, v, z = groups.split(
        [s.head_k_dim, s.head_k_dim, per_group * s.head_v_dim, per_group * s.head_v_dim], 1
    )
    b, a = ba.view(s.num_k_heads, 2 * per_group, hidden).split(per_group, 1)
    qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])
    return qkv, z.reshape(-1, hidden), b.reshape(-1, hidden), a.reshape(-1, hidden)


class GatedDeltaNet:
    """One linear-attention layer's weights and its forward for one sequence."""

    def __init__(self, shape: DeltaNetShape, weights: dict[str, torch.Tensor]):
        """`weights`: one decoder layer's tensors under Hugging Face's names, the layer's
        prefix (`model.layers.{i}.`) taken off, as `transformer.Layer` receives them:
        `linear_attn.in_proj_qkv.weight`, `..._z`, `..._b`, `..._a` (Qwen3.5), or
        `linear_attn.in_proj_qkvz.weight` and `..._ba` (Qwen3-Next); `conv1d.weight`,
        `dt_bias`, `A_log`, `norm.weight`, `out_proj.weight`. A quantized file's layers
        come built (`gguf.weights.delta_net_linears`): `linear_attn.in_proj` (the four
        projections fused, in this order) and `linear_attn.out_proj` take the place of
        the dense ones."""
        s = self.shape = shape
        w = {k.removeprefix("linear_attn."): v for k, v in weights.items()}
        built = w.get("in_proj")
        if built is not None:
            self.in_proj: Linear = built
        else:
            if "in_proj_qkvz.weight" in w:
                qkv, z, b, a = split_qwen3_next(s, w["in_proj_qkvz.weight"], w["in_proj_ba.weight"])
            else:
                qkv, z, b, a = (w[f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a"))
            # one matmul for the four projections of the same input, as kvchat fuses q/k/v
            self.in_proj = make_linear([qkv, z, b, a])  # [conv_dim + value_dim + 2 Hv, hidden]
        projected = s.conv_dim + s.value_dim + 2 * s.num_v_heads
        if (self.in_proj.out_features, self.in_proj.in_features) != (projected, s.hidden_size):
            raise ModelLoadError(
                f"the Gated DeltaNet's projections make {self.in_proj.out_features} rows of "
                f"{self.in_proj.in_features} where the config makes {projected} of "
                f"{s.hidden_size}; the model's files disagree with its config."
            )
        self.conv_weight = w["conv1d.weight"]  # [conv_dim, 1, K]: depthwise, no bias
        self.dt_bias = w["dt_bias"]  # [Hv]
        # [Hv]: -A, in float32 as transformers takes it (exp of A_log may overflow fp16)
        self.decay_rate = -w["A_log"].float().exp()
        self.norm = w["norm.weight"]  # [Dv]: a plain weight (not 1 + w as the decoder's norms)
        # [hidden, value_dim]
        self.out_proj: Linear = w.get("out_proj") or make_linear([w["out_proj.weight"]])
        if self.conv_weight.shape != (s.conv_dim, 1, s.conv_kernel):
            raise ModelLoadError(
                f"conv1d.weight is {tuple(self.conv_weight.shape)} where the config makes "
                f"{(s.conv_dim, 1, s.conv_kernel)}; the model's files disagree with its config."
            )

    def zero_state(self, device: torch.device | str | None = None) -> DeltaNetState:
        return DeltaNetState.zeros(self.shape, self.norm.dtype, device or self.norm.device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the normalized residual stream of one sequence
        state: DeltaNetState,
    ) -> tuple[torch.Tensor, DeltaNetState]:
        """(output [T, hidden], the state after these T tokens). The chunked rule for a
        prefill (T > 1) from any state, the recurrent rule for one decoded token."""
        out, new_state, _ = self.forward_keeping(x, state, ())
        return out, new_state

    def forward_keeping(
        self, x: torch.Tensor, state: DeltaNetState, keep_at: Sequence[int]
    ) -> tuple[torch.Tensor, DeltaNetState, list[DeltaNetState]]:
        """`forward`, and the states after the first `o` tokens for each `o` in `keep_at`
        (ascending, 1 to T): the engine keeps the state where a page of the cache ends,
        so a conversation can later resume there. The rule runs segment by segment
        between those points (the same recurrence, cut where a state is wanted)."""
        s = self.shape
        t = x.shape[0]
        projected = self.in_proj(x)  # [T, conv_dim + value_dim + 2 Hv]
        mixed, z, b, a = projected.split(
            [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], -1
        )

        # causal depthwise convolution over the state's K - 1 inputs and these T
        window = torch.cat([state.conv, mixed])  # [K - 1 + T, conv_dim]
        conv = F.conv1d(
            window.T.unsqueeze(0).to(self.conv_weight.dtype), self.conv_weight, groups=s.conv_dim
        )
        mixed = F.silu(conv[0].T).to(x.dtype)  # [T, conv_dim]

        # copies: a view would keep the whole prefill's window alive with the state; the
        # state after o tokens convolves the K - 1 inputs before token o next
        def conv_after(o: int) -> torch.Tensor:
            return window[o : o + s.conv_kernel - 1].clone()

        new_conv = conv_after(t)

        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], -1)
        beta = b.sigmoid()  # [T, Hv]: in the activation dtype, as transformers rounds it
        g = self.decay_rate * F.softplus(a.float() + self.dt_bias)  # [T, Hv], log of the decay

        # float32 from here, heads first: [H, T, D]; each key head repeated for the value
        # heads it serves
        per_group = s.num_v_heads // s.num_k_heads
        q, k = (
            _l2norm(y.view(t, s.num_k_heads, s.head_k_dim).float())
            .repeat_interleave(per_group, 1)
            .transpose(0, 1)
            for y in (q, k)
        )
        q = q * s.head_k_dim**-0.5
        v = v.view(t, s.num_v_heads, s.head_v_dim).float().transpose(0, 1)
        beta, g = beta.float().T, g.T  # [Hv, T]
        recurrent, parts, kept = state.recurrent, [], []
        bounds = [0, *(o for o in keep_at if 0 < o < t), t]
        for a, b in itertools.pairwise(bounds):
            rule = recurrent_rule if b - a == 1 else chunk_rule
            part, recurrent = rule(
                q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], recurrent
            )  # [Hv, b - a, Dv]
            parts.append(part)
            if b < t:
                kept.append(DeltaNetState(conv_after(b), recurrent))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

        out = self._gated_norm(
            out.transpose(0, 1).to(x.dtype), z.view(t, s.num_v_heads, s.head_v_dim)
        )
        final = DeltaNetState(new_conv, recurrent)
        if keep_at and keep_at[-1] == t:
            kept.append(final)
        return self.out_proj(out.reshape(t, s.value_dim)), final, kept

    __call__ = forward

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' Qwen3_5RMSNormGated over each head's Dv: statistics in float32,
        cast back before the weight, then times silu(z) in float32, cast back."""
        of = o.float()
        inverse_rms = torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        normed = (of * inverse_rms).to(o.dtype)
        return ((self.norm * normed) * F.silu(z.float())).to(o.dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's (and transformers') L2 norm: eps inside the square root."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_rule(
    q: torch.Tensor,  # [H, T, Dk], float32, normalized and scaled
    k: torch.Tensor,  # [H, T, Dk], float32, normalized
    v: torch.Tensor,  # [H, T, Dv], float32
    g: torch.Tensor,  # [H, T]: log of each token's decay (<= 0)
    beta: torch.Tensor,  # [H, T]: each token's write strength, in (0, 1)
    state: torch.Tensor,  # [H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a token at a time: (outputs [H, T, Dv], the final state)."""
    state = state.float()
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[:, None, None]
        predicted = (state * k[:, i, :, None]).sum(-2)  # [H, Dv]: k^T S
        delta = (v[:, i] - predicted) * beta[:, i, None]
        state = state + k[:, i, :, None] * delta[:, None, :]
        out[:, i] = (state * q[:, i, :, None]).sum(-2)
    return out, state


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule as `recurrent_rule` (same arguments and result), `chunk` tokens at a
    time: transformers' `torch_chunk_gated_delta_rule` for one sequence.

    Within a chunk, the T delta-rule writes compose into a lower-triangular system: with
    W = tril(beta_i k_i . k_j * decay(j -> i)), the values actually written are
    U = (I + W)^-1 (beta V) less what the state entering the chunk already predicts.
    Padding tokens (g = 0, beta = 0) neither decay nor write, so the state is exact."""
    h, t, dv = v.shape
    pad = (-t) % chunk
    q, k, v = (F.pad(y, (0, 0, 0, pad)) for y in (q, k, v))
    g, beta = (F.pad(y, (0, pad)) for y in (g, beta))
    n = (t + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (y.view(h, n, chunk, -1) for y in (q, k, k_beta, v_beta))
    g = g.view(h, n, chunk).cumsum(-1)  # [H, n, C]: log decay from the chunk's start

    # decay[i, j] = exp(g_i - g_j): what token j's write has decayed by at token i (j <= i)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [H, n, C, C]; its diagonal is ignored
    attention = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C]: within the chunk
    solve = torch.linalg.solve_triangular
    values = solve(system, v_beta, upper=False, unitriangular=True)  # [H, n, C, Dv]
    # what the incoming state predicts for each write, decayed to the token
    keys_read = solve(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)

    q = q * g.exp()[..., None]  # reads the incoming state decayed to the token
    k = k * (g[..., -1:] - g).exp()[..., None]  # writes decayed to the chunk's end
    chunk_decay = g[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    state = state.float()
    out = q.new_empty(h, n, chunk, dv)
    for i in range(n):
        written = values[:, i] - keys_read[:, i] @ state  # [H, C, Dv]
        out[:, i] = q[:, i] @ state + attention[:, i] @ written
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ written
    return out.view(h, -1, dv)[:, :t], state
