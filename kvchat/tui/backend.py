"""What the TUI runs on: a chat backend plus its defaults, and the real one's start-up function.

Why a factory: the app is built around a `BackendFactory` so that tests inject a
fake engine while `kvchat` loads the model. `start_real_backend` is the only
place the TUI reaches `kvchat.runtime` (which imports torch), and it imports it
inside the function: it runs in a thread worker, so the UI keeps painting the
progress while the model loads, and no `kvchat.tui` module imports torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.settings import Settings
from kvchat.engine.api import SamplingParams

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelChoice:
    """A model the picker offers: its name (what `--model` takes), where it was found,
    a line of facts, whether it is the one running, and why kvchat cannot run it."""

    name: str
    source: str
    detail: str
    current: bool = False
    reason: str | None = None


@dataclass(frozen=True)
class TuiBackend:
    chat: ChatBackend
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    default_max_tokens: int = 512
    description: str = ""  # one line about the model and its cache, shown in the meters
    # the same line as it is now (the attention kernel may finish compiling after start)
    describe: Callable[[], str] | None = None
    close: Callable[[], None] = lambda: None  # stops the engine
    notices: tuple[str, ...] = ()  # shown as warnings once kvchat is ready
    # the models the picker offers, and a backend for another of them (None: this
    # backend cannot switch, e.g. a remote server)
    models: Callable[[], tuple[ModelChoice, ...]] = tuple
    switch: Callable[[str, Progress], TuiBackend] | None = None
    # the model as it was asked for (what sessions remember), and whether a model so
    # named is on this machine now
    model_name: str = ""
    has_model: Callable[[str], bool] = lambda _name: True

    def service_options(self) -> dict[str, Any]:
        """What `SessionService` (and its `replace_backend`) take from this backend
        beside its engine and renderer."""
        return {
            "stop_token_ids": self.chat.stop_token_ids,
            "default_sampling": self.default_sampling,
            "default_max_tokens": self.default_max_tokens,
            "model_name": self.model_name,
        }


BackendFactory = Callable[[Progress], TuiBackend]


def start_real_backend(
    args: argparse.Namespace, settings: Settings, progress: Progress
) -> TuiBackend:
    """Load the model (fetching/converting the default one on first run) and start its engine.

    Raises `KvchatError` (e.g. `ModelLoadError`) with a message saying what to do.
    """
    from kvchat.remote.options import remote_options
    from kvchat.runtime import model_spec_name, open_chat_backend, resolve_options

    options = resolve_options(args, settings)
    remote = remote_options(args, settings)
    if remote is not None:
        progress(f"Connecting to {remote.url} ...")
    backend = open_chat_backend(options, settings, progress, greedy=False, remote=remote)

    def models() -> tuple[ModelChoice, ...]:
        from kvchat.runtime import model_choices

        return tuple(
            ModelChoice(c.name, c.source, c.detail, c.current, c.reason)
            for c in model_choices(options.model, settings.model_dirs)
        )

    def has_model(name: str) -> bool:
        from kvchat.runtime import model_available

        return model_available(name, settings.model_dirs)

    def switch(name: str, progress: Progress) -> TuiBackend:
        return start_real_backend(
            argparse.Namespace(**{**vars(args), "model": name}), settings, progress
        )

    return TuiBackend(
        chat=backend.chat,
        default_sampling=backend.sampling,
        default_max_tokens=options.max_tokens or settings.max_tokens,
        description=backend.describe(),
        describe=backend.describe,
        close=backend.close,
        notices=backend.notices,
        models=models,
        switch=None if remote is not None else switch,
        model_name="" if remote is not None else model_spec_name(options.model),
        has_model=has_model,
    )
