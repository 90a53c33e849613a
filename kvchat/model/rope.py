"""Rotary position embeddings, as Hugging Face's Llama computes them.

The cos/sin table is built once in float32 (like transformers) and cast to the
activation dtype; a forward gathers the rows of its positions once and every
layer reuses them (`decoder_ops.rotate_` applies them).
"""

from __future__ import annotations

import math

import torch

from kvchat.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # "llama3": long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1 paper, section 3; transformers' _compute_llama3_parameters).
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTable:
    """cos/sin for every position up to the context length, in the activation dtype."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device):
        inv_freq = inverse_frequencies(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_first_half, sin_second_half]
        half = emb.shape[-1] // 2
        signed = emb.sin()
        signed[:, :half] = -signed[:, :half]
        self.sin = signed.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each position, [T, D] (`decoder_ops.rotate_` applies them)."""
        return self.cos[positions], self.sin[positions]
