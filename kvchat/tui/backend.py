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

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.settings import Settings
from kvchat.engine.api import SamplingParams

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TuiBackend:
    chat: ChatBackend
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    default_max_tokens: int = 512
    description: str = ""  # one line about the model and its cache, shown in the meters
    # the same line as it is now (the attention kernel may finish compiling after start)
    describe: Callable[[], str] | None = None
    close: Callable[[], None] = lambda: None  # stops the engine


BackendFactory = Callable[[Progress], TuiBackend]


def start_real_backend(
    args: argparse.Namespace, settings: Settings, progress: Progress
) -> TuiBackend:
    """Load the model (fetching/converting the default one on first run) and start its engine.

    Raises `KvchatError` (e.g. `ModelLoadError`) with a message saying what to do.
    """
    from kvchat.remote.options import remote_options
    from kvchat.runtime import describe_cache, resolve_options, start_engine

    options = resolve_options(args, settings)
    remote = remote_options(args, settings)
    if remote is not None:
        return _start_remote_backend(remote, options, settings, progress)
    model, engine = start_engine(options, progress)
    defaults = dict(model.generation_defaults)
    if options.temperature is not None:
        defaults["temperature"] = options.temperature
    if settings.top_p is not None:
        defaults["top_p"] = settings.top_p
    sampling = SamplingParams(
        temperature=float(defaults.get("temperature", 0.7)),
        top_p=float(defaults.get("top_p", 0.9)),
        top_k=int(defaults.get("top_k", 0)),
        min_p=float(defaults.get("min_p", 0.0)),
        repetition_penalty=float(defaults.get("repetition_penalty", 1.0)),
        seed=options.seed,
    )
    chat = ChatBackend(engine, model.renderer, frozenset(model.tokenizer.stop_token_ids))

    def describe() -> str:
        try:
            return f"{model.name}: {describe_cache(engine)}"
        except Exception:  # a line of information must never stop the start
            return model.name

    return TuiBackend(
        chat=chat,
        default_sampling=sampling,
        default_max_tokens=options.max_tokens or settings.max_tokens,
        description=describe(),
        describe=describe,
        close=engine.close,
    )


def _start_remote_backend(remote, options, settings: Settings, progress: Progress) -> TuiBackend:
    """Connect to an OpenAI-compatible server; the meters' note shows its own figures."""
    from kvchat.remote import open_remote_backend

    progress(f"Connecting to {remote.url} ...")
    chat = open_remote_backend(remote)
    engine = chat.engine
    progress(engine.connected_line())
    sampling = SamplingParams(
        temperature=0.7 if options.temperature is None else options.temperature,
        top_p=0.9 if settings.top_p is None else settings.top_p,
        seed=options.seed,
    )
    return TuiBackend(
        chat=chat,
        default_sampling=sampling,
        default_max_tokens=options.max_tokens or settings.max_tokens,
        description=engine.cache_note(),
        describe=engine.cache_note,
        close=engine.close,
    )
