"""Rotary position embeddings, as Hugging Face's Llama computes them.

The cos/sin table is built once in float32 (like transformers) and cast to the
activation dtype; a forward gathers the rows of its positions once and every
layer reuses them (`decoder_ops.rotate_` applies them).

LongRoPE (Phi-3) has two sets of frequencies, for contexts up to the original length
and beyond it. transformers switches between them by the length of what it runs, which
would leave a cache's keys rotated by the other set; kvchat, as llama.cpp, picks one by
the context it runs (`longrope_set`), so a conversation never mixes them, and names
the set in the cache's salt.
"""

from __future__ import annotations

import math

import torch

from kvchat.errors import ModelLoadError
from kvchat.model.config import ModelConfig


def longrope_set(config: ModelConfig, context: int) -> str | None:
    """ "short" or "long": LongRoPE's frequencies for a context of `context` tokens;
    None for the other rotary kinds (one set at every context)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.kind != "longrope":
        return None
    return "long" if context > scaling.original_max_position_embeddings else "short"


def inverse_frequencies(config: ModelConfig, context: int | None = None) -> torch.Tensor:
    dim = config.rotary_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "longrope":
        chosen = longrope_set(config, context or config.max_position_embeddings)
        factors = scaling.long_factor if chosen == "long" else scaling.short_factor
        if len(factors) != inv_freq.numel():
            raise ModelLoadError(
                f"The model's LongRoPE factors number {len(factors)}, not {inv_freq.numel()} "
                "(half the rotary dimensions); its config is damaged. Re-download it."
            )
        # transformers: 1 / (factor * theta^(2i/d)), the division done once, in float32
        return 1.0 / (
            torch.tensor(factors, dtype=torch.float32)
            * config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(config)
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


def _yarn_frequencies(config: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023), as transformers' _compute_yarn_parameters: frequencies that
    turn more than `beta_fast` times over the original context are kept, those under
    `beta_slow` interpolated by `factor`, those between blended along a linear ramp."""
    scaling = config.rope_scaling
    assert scaling is not None
    dim, base = config.rotary_dim, config.rope_theta
    original = scaling.original_max_position_embeddings

    def dimension_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where a frequency is kept as it is
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (scaling.factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


class RotaryTable:
    """cos/sin for every position up to the context length, in the activation dtype
    ([P, D] for the rotary dimensions D, which are all of a head's unless it rotates
    only part)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        device,
        context: int | None = None,
    ):
        inv_freq = inverse_frequencies(config, context or max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        scaling = config.rope_scaling
        scaled = scaling is not None and scaling.kind in ("longrope", "yarn")
        scale = scaling.attention_factor if scaled else 1.0
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, D/2) * [-sin_first_half, sin_second_half]
        half = emb.shape[-1] // 2
        signed = emb.sin() * scale
        signed[:, :half] = -signed[:, :half]
        self.sin = signed.to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each position, [T, D] (`decoder_ops.rotate_` applies them)."""
        return self.cos[positions], self.sin[positions]
