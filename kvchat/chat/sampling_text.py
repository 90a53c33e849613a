"""Sampling parameters as a line of text a user edits: `temperature=0.7 top_p=0.9 ...`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvchat.engine.api import SamplingParams
from kvchat.errors import KvchatError


def parse_sampling(text: str, base: SamplingParams, max_tokens: int) -> tuple[SamplingParams, int]:
    """`temperature=0.7 top_p=0.9 ... max_tokens=512` into values; KvchatError names a bad one."""
    values: dict[str, Any] = {}
    new_max = max_tokens
    for part in text.replace(",", " ").split():
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep:
            raise KvchatError(f"write name=value pairs, like temperature=0.7 (not {part!r})")
        try:
            if key == "max_tokens":
                new_max = int(raw)
                if new_max <= 0:
                    raise ValueError
            elif key in ("top_k",):
                values[key] = int(raw)
            elif key == "seed":
                values[key] = None if raw in ("", "none", "None") else int(raw)
            elif key in ("temperature", "top_p", "min_p", "repetition_penalty"):
                values[key] = float(raw)
            else:
                raise KvchatError(
                    f"unknown sampling parameter {key!r} (known: temperature, top_p, top_k, "
                    "min_p, repetition_penalty, seed, max_tokens)"
                )
        except ValueError:
            raise KvchatError(f"{key}: {raw!r} is not a valid value") from None
    sampling = replace(base, **values)
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
        raise KvchatError("temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    return sampling, new_max


def sampling_text(sampling: SamplingParams, max_tokens: int) -> str:
    seed = "none" if sampling.seed is None else str(sampling.seed)
    return (
        f"temperature={sampling.temperature:g} top_p={sampling.top_p:g} top_k={sampling.top_k} "
        f"min_p={sampling.min_p:g} repetition_penalty={sampling.repetition_penalty:g} "
        f"seed={seed} max_tokens={max_tokens}"
    )
