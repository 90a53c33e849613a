"""Turn command-line options and the settings file into a loaded model and a running engine.

Precedence: a command-line option, then the settings file, then kvchat's default.
Shared by the TUI, `ask`, `run` and `bench` so each option means one thing everywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from kvchat.chat.settings import Settings, load_settings
from kvchat.engine.config import DEFAULT_PAGE_SIZE, EngineConfig
from kvchat.errors import KvchatError
from kvchat.units import parse_size


@dataclass(frozen=True)
class RuntimeOptions:
    model: str | None
    dtype: str | None
    device: str | None
    device_cache: int | None
    host_cache: int | None
    page_size: int
    seed: int | None
    temperature: float | None
    max_tokens: int | None
    weights: str = "native"
    quantize: str | None = None
    kv: str = "native"


def read_settings(warn: Callable[[str], None] | None = None) -> Settings:
    """The settings file, or defaults with a warning when it is broken (never overwritten)."""
    try:
        return load_settings()
    except KvchatError as exc:
        (warn or (lambda m: print(m, file=sys.stderr)))(f"kvchat: {exc} Using the defaults.")
        return Settings()


def resolve_options(args: argparse.Namespace, settings: Settings) -> RuntimeOptions:
    def pick(name: str):
        value = getattr(args, name, None)
        return value if value is not None else getattr(settings, name, None)

    def size(name: str) -> int | None:
        value = getattr(args, name, None)
        if value is not None:
            return parse_size(value)
        return getattr(settings, name, None)

    return RuntimeOptions(
        model=pick("model"),
        dtype=pick("dtype"),
        device=getattr(args, "device", None),
        device_cache=size("device_cache"),
        host_cache=size("host_cache"),
        page_size=pick("page_size") or DEFAULT_PAGE_SIZE,
        seed=pick("seed"),
        temperature=pick("temperature"),
        max_tokens=pick("max_tokens"),
        weights=pick("weights") or "native",
        quantize=pick("quantize"),
        kv=pick("kv") or "native",
    )


def engine_config(options: RuntimeOptions) -> EngineConfig:
    return EngineConfig(
        page_size=options.page_size,
        device_cache_bytes=options.device_cache,
        host_cache_bytes=options.host_cache,
        kv_format=options.kv,
    )


def start_engine(options: RuntimeOptions, progress: Callable[[str], None]):
    """Load the model and start its engine; returns (model, engine)."""
    from kvchat.engine.engine import Engine
    from kvchat.model.loader import load_model

    def load():
        return load_model(
            options.model,
            dtype=options.dtype,
            device=options.device,
            weights=options.weights,
            quantize=options.quantize,
            progress=progress,
        )

    import torch

    from kvchat.native import build as native_build

    if options.device == "cpu" or (options.device is None and not torch.cuda.is_available()):
        native_build.request()  # compiles (first run only) while the model loads
    engine = Engine.launch(load, engine_config(options))  # all torch work on one thread
    return engine.model, engine


def describe_cache(engine) -> str:
    """One line a user can read at start: where the KV cache lives, how big it is, and
    which attention reads it."""
    from kvchat.native import build as native_build

    s = engine.stats()
    ps = s.page_size
    dev = s.pages["device"].capacity
    host = s.pages["host"].capacity
    per_page = engine.store.nbytes() // max(dev, 1)
    return (
        f"KV cache: {dev} pages x {ps} tokens on {engine.transformer.device.type} "
        f"({dev * ps:,} tokens, {dev * per_page / 2**20:.0f} MiB), host tier {host} pages "
        f"({host * ps:,} tokens, {host * per_page / 2**20:.0f} MiB); attention: "
        f"{native_build.summary(engine.transformer.device)}"
    )
