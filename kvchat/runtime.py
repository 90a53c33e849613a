"""Turn command-line options and the settings file into a loaded model and a running engine.

Precedence: a command-line option, then the settings file, then kvchat's default.
Shared by the TUI, `ask`, `run` and `bench` so each option means one thing everywhere;
`open_chat_backend` is the one place a chat backend (engine and sampling defaults) is
opened.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.settings import (
    MIN_CONTEXT_SIZE,
    MIN_PAGE_SIZE,
    Settings,
    is_context_size,
    is_page_size,
    load_settings_checked,
)
from kvchat.engine.api import SamplingParams
from kvchat.errors import KvchatError, UsageError
from kvchat.units import format_size, parse_size

if TYPE_CHECKING:
    from kvchat.remote.server import RemoteOptions


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
    attention: str | None = None  # None: the device's default (flex on CUDA, native else)
    # option -> where its value came from ("--device-cache", or "FILE, line N" in the settings)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    disk_cache: int | None = None  # None: the default size (`disk_cache_bytes`)
    context_size: int | None = None  # None: the model's context
    model_dirs: tuple[str, ...] = ()  # the settings' folders a model name is looked up in


def read_settings(warn: Callable[[str], None] | None = None) -> Settings:
    """The settings file's good values; each bad key warned about once, with its default
    in use (the file is never overwritten)."""
    settings, problems = load_settings_checked()
    for problem in problems:
        (warn or (lambda m: print(m, file=sys.stderr)))(
            f"kvchat: {problem} Its default is used; the file is left as it is."
        )
    return settings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_options(args: argparse.Namespace, settings: Settings) -> RuntimeOptions:
    """The options in force; UsageError (exit 2) for a bad command-line value, naming the flag.

    The settings file's values were checked when it was read (`parse_settings`).
    """
    sources: dict[str, str] = {}

    def pick(name: str):
        value = getattr(args, name, None)
        if value is not None:
            sources[name] = _flag(name)
            return value
        value = getattr(settings, name, None)
        if value is not None and name in settings.sources:
            sources[name] = f"the settings file {settings.sources[name]}"
        return value

    def size(name: str, *, zero_is_off: bool) -> int | None:
        value = getattr(args, name, None)
        if value is None:
            return pick(name)
        try:
            parsed = parse_size(value)
        except UsageError as exc:
            raise UsageError(f"{_flag(name)}: {exc}") from None
        if parsed == 0 and not zero_is_off:
            raise UsageError(
                f"{_flag(name)} 0: this cache cannot be off; give its size with a unit, like "
                "512MiB, or leave the flag out for the default"
            )
        sources[name] = _flag(name)
        return parsed

    page_size = getattr(args, "page_size", None)
    if page_size is not None and not is_page_size(page_size):
        raise UsageError(
            f"--page-size must be a power of two from {MIN_PAGE_SIZE} up, like 256; got {page_size}"
        )
    context_size = getattr(args, "context_size", None)
    if context_size is not None and not is_context_size(context_size):
        raise UsageError(
            f"--context-size must be an integer from {MIN_CONTEXT_SIZE} up, like 4096; "
            f"got {context_size}"
        )
    max_tokens = getattr(args, "max_tokens", None)
    if max_tokens is not None and max_tokens <= 0:
        raise UsageError(f"--max-tokens must be a positive integer; got {max_tokens}")
    temperature = getattr(args, "temperature", None)
    if temperature is not None and not temperature >= 0:
        raise UsageError(
            f"--temperature must be a number at least 0 (0 is greedy); got {temperature}"
        )
    device_cache = size("device_cache", zero_is_off=False)
    host_cache = size("host_cache", zero_is_off=True)
    disk_cache = size("disk_cache", zero_is_off=True)
    if disk_cache:
        _check_disk_room(disk_cache, sources.get("disk_cache", "--disk-cache"))
    return RuntimeOptions(
        model=pick("model"),
        dtype=pick("dtype"),
        device=getattr(args, "device", None),
        device_cache=device_cache,
        host_cache=host_cache,
        page_size=pick("page_size"),  # the settings' default when neither sets it
        seed=pick("seed"),
        temperature=pick("temperature"),
        max_tokens=pick("max_tokens"),
        weights=pick("weights") or "native",
        quantize=pick("quantize"),
        kv=pick("kv") or "native",
        attention=pick("attention"),
        sources=sources,
        disk_cache=disk_cache,
        context_size=pick("context_size"),
        model_dirs=settings.model_dirs,
    )


def _check_disk_room(size: int, source: str) -> None:
    """Refuse a disk tier its disk cannot hold (its own page files count as room: the tier
    replaces them), before anything loads: accepted, it would fail writes for good later."""
    from kvchat.engine.tiers.disk_tier import free_disk_bytes
    from kvchat.paths import app_paths
    from kvchat.units import format_size

    folder = app_paths().kv_cache_dir
    free = free_disk_bytes(folder)
    if free is None:
        return  # nothing known to refuse it on
    own = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
    room = free + own
    if size > room:
        raise UsageError(
            f"{source}: a disk tier of {format_size(size)} does not fit: the disk holding "
            f"{folder} has {format_size(free)} free"
            + (f" (and the tier's files use {format_size(own)})" if own else "")
            + f". Give at most {format_size(room * 9 // 10)}, or 0 to turn the tier off."
        )


def disk_cache_bytes(options: RuntimeOptions) -> int:
    """The disk tier's size: as set, else 8 GiB or a tenth of the free disk, the smaller."""
    from kvchat.engine.tiers.disk_tier import default_disk_cache_bytes
    from kvchat.paths import app_paths

    if options.disk_cache is not None:
        return options.disk_cache
    return default_disk_cache_bytes(app_paths().kv_cache_dir)


def engine_config(options: RuntimeOptions):
    from kvchat.engine.config import EngineConfig

    return EngineConfig(
        page_size=options.page_size,
        device_cache_bytes=options.device_cache,
        host_cache_bytes=options.host_cache,
        kv_format=options.kv,
        attention=options.attention,
        disk_cache_bytes=disk_cache_bytes(options),
        context_tokens=options.context_size,
    )


def start_engine(options: RuntimeOptions, progress: Callable[[str], None]):
    """Load the model and start its engine; returns (model, engine)."""
    import torch

    from kvchat.engine.config import available_memory
    from kvchat.engine.engine import Engine
    from kvchat.model.loader import load_model
    from kvchat.native import build as native_build

    ram_before_load = available_memory(torch.device("cpu"))

    def load():
        from kvchat.model.registry import DEFAULT_ALIASES, resolve_model

        path = resolve_model(options.model, progress, model_dirs=options.model_dirs)
        asked = options.model
        # a model asked by name (`llama3.2:1b`) is shown by it, not by its file's name
        by_name = asked is not None and not Path(asked).expanduser().exists()
        model = load_model(
            str(path),
            name=asked if by_name and asked.lower() not in DEFAULT_ALIASES else None,
            dtype=options.dtype,
            device=options.device,
            weights=options.weights,
            quantize=options.quantize,
            progress=progress,
        )
        check_cache_budget(model, options, ram_before_load)  # before the cache is allocated
        return model

    from kvchat.engine.attention.attention_choice import resolve_attention
    from kvchat.model.device import parse_device

    # refused before the model loads: a choice this device or KV format cannot run
    device = parse_device(options.device)
    attention = resolve_attention(options.attention, device, options.kv)
    if device.type == "cpu":  # attention and 4-bit matmul kernels: built once, in the background
        native_build.request()
    if attention == "flex":
        from kvchat.engine.attention.flex_attention import configure_compile_cache
        from kvchat.paths import app_paths

        configure_compile_cache(app_paths().cache_dir / "compiled")
    try:
        engine = Engine.launch(load, engine_config(options))  # all torch work on one thread
    except (RuntimeError, MemoryError) as exc:  # what the budget could not foresee
        if not isinstance(exc, torch.OutOfMemoryError | MemoryError) and (
            "allocate" not in str(exc)
        ):
            raise
        raise KvchatError(
            f"out of memory while loading the model and allocating its KV cache "
            f"({str(exc).splitlines()[0][:200]}); give --device-cache and --host-cache "
            "smaller sizes, or close other programs."
        ) from None
    return engine.model, engine


def check_cache_budget(model, options: RuntimeOptions, ram_before_load: int) -> None:
    """UsageError when the cache sizes (given or default) do not fit in this machine."""
    import torch

    from kvchat.cache_budget import CacheRequest, check_cpu_budget, check_gpu_budget
    from kvchat.engine.config import available_memory, default_cache_bytes

    device = model.transformer.device
    default_device, default_host = default_cache_bytes(device)
    request = CacheRequest.of(
        options.device_cache or default_device,
        default_host if options.host_cache is None else options.host_cache,
        options.sources,
    )
    if device.type == "cpu":
        check_cpu_budget(request, model.transformer.weight_bytes(), ram_before_load)
    else:
        check_gpu_budget(request, available_memory(device), available_memory(torch.device("cpu")))


def greedy_sampling(options: RuntimeOptions) -> SamplingParams:
    """`run` and `ask`: greedy unless the command line sets a temperature.

    The settings file's temperature is the TUI's chat default, so it does not count here.
    """
    from_command_line = options.sources.get("temperature") == _flag("temperature")
    temperature = options.temperature if from_command_line else None
    return SamplingParams(temperature=temperature or 0.0, top_p=1.0, seed=options.seed)


def chat_sampling(
    options: RuntimeOptions, settings: Settings, generation_defaults: Mapping[str, float]
) -> SamplingParams:
    """The TUI's defaults: the model's generation config, then the options and settings."""
    defaults = dict(generation_defaults)
    if options.temperature is not None:
        defaults["temperature"] = options.temperature
    if settings.top_p is not None:
        defaults["top_p"] = settings.top_p
    return SamplingParams(
        temperature=float(defaults.get("temperature", 0.7)),
        top_p=float(defaults.get("top_p", 0.9)),
        top_k=int(defaults.get("top_k", 0)),
        min_p=float(defaults.get("min_p", 0.0)),
        repetition_penalty=float(defaults.get("repetition_penalty", 1.0)),
        seed=options.seed,
    )


@dataclass(frozen=True)
class OpenedBackend:
    """A chat backend ready for the session layer, with the sampling its command defaults to."""

    chat: ChatBackend
    sampling: SamplingParams
    describe: Callable[[], str]  # one line about the model and its cache (never raises)
    close: Callable[[], None]  # stops the engine or closes the connection
    notices: tuple[str, ...] = ()  # warnings for the user at start (a too-small cache)


def open_chat_backend(
    options: RuntimeOptions,
    settings: Settings,
    progress: Callable[[str], None],
    *,
    greedy: bool,
    remote: RemoteOptions | None = None,
) -> OpenedBackend:
    """The one way `ask`, `run` and the TUI open a chat backend: engine and sampling defaults.

    The embedded engine (the model loaded, its engine started), or with `remote` an
    OpenAI-compatible server. `greedy` for the scripted commands (`greedy_sampling`),
    else the chat defaults (`chat_sampling`). Raises `KvchatError` saying what to do.
    """
    if remote is not None:
        from kvchat.remote import open_remote_backend

        chat = open_remote_backend(remote)
        server = chat.engine
        progress(server.connected_line())
        sampling = greedy_sampling(options) if greedy else chat_sampling(options, settings, {})
        return OpenedBackend(chat, sampling, server.cache_note, server.close)
    model, engine = start_engine(options, progress)
    chat = ChatBackend(engine, model.renderer, frozenset(model.tokenizer.stop_token_ids))
    if greedy:
        sampling = greedy_sampling(options)
    else:
        sampling = chat_sampling(options, settings, model.generation_defaults)

    def describe() -> str:
        try:
            return f"{model.name}: {describe_cache(engine)}"
        except Exception:  # a line of information must never stop the start
            return model.name

    notices = tuple(
        n
        for n in (
            context_notice(engine, options),
            window_notice(engine),
            small_cache_notice(engine),
        )
        if n is not None
    )
    for notice in notices:
        progress(notice)
    return OpenedBackend(chat, sampling, describe, engine.close, notices)


def context_notice(engine, options: RuntimeOptions) -> str | None:
    """A context size above the model's is capped to it: said once at start."""
    asked = options.context_size
    if asked is None or asked <= engine.context_length:
        return None
    where = options.sources.get("context_size", "--context-size")
    return (
        f"The context size {asked:,} ({where}) is more than the model's context; "
        f"{engine.context_length:,} tokens are used."
    )


def window_notice(engine) -> str | None:
    """A model that attends within a window runs with its context capped at the window
    (`ModelConfig.sliding_window`): said once at start, with the reason."""
    window = getattr(engine.model.config, "sliding_window", None)
    if window is None or engine.context_length > window:
        return None
    return (
        f"This model attends to the last {window:,} tokens only (sliding-window "
        f"attention): kvchat runs its conversations up to {window:,} tokens, where that is "
        "the model's exact computation."
    )


def small_cache_notice(engine) -> str | None:
    """A warning when the device cache holds fewer tokens than the model's context: a
    conversation longer than the cache can never be answered (every page of a sequence
    is on the device while it runs), and a user who set 48MiB learns it at start rather
    than at the turn that fails, with the size that would hold a whole context."""
    holds, context = engine.device_cache_tokens, engine.context_length
    if holds >= context:
        return None
    return (
        f"The device cache holds {holds:,} tokens, fewer than the model's context "
        f"({context:,}): a conversation longer than {holds:,} tokens cannot be answered. "
        f"--device-cache {engine.device_cache_mib_for(context)}MiB holds a whole context."
    )


def describe_cache(engine) -> str:
    """One line a user can read at start: where the KV cache lives, how big it is, and
    which attention reads it."""
    from kvchat.engine.attention.attention_choice import describe_attention

    s = engine.stats()
    ps = s.page_size
    dev = s.pages.device.capacity
    host = s.pages.host.capacity
    host_bytes = engine.host_store.nbytes() if engine.host_store is not None else 0
    window = engine.table.window
    window_text = (
        f"; the windowed layers keep {window.num_slots - 1} pages' worth, their window's "
        f"for each conversation"
        if window is not None and not window.unbounded
        else ""
    )
    disk = s.pages.disk
    disk_text = (
        f"disk tier {format_size(s.disk_bytes.capacity)} at {engine.disk.root} "
        f"({disk.cached} pages of this model found)"
        if disk is not None and engine.disk is not None
        else "disk tier off"
    )
    if s.disk_notice:
        disk_text += f" ({s.disk_notice})"
    return (
        f"KV cache: {dev} pages x {ps} tokens on {engine.transformer.device.type} "
        f"({dev * ps:,} tokens, {engine.kv_store_bytes / 2**20:.0f} MiB{window_text}), "
        f"host tier {host} pages ({host * ps:,} tokens, {host_bytes / 2**20:.0f} MiB), "
        f"{disk_text}; context "
        f"{engine.context_length:,} tokens; attention: "
        f"{describe_attention(engine.attention_kind, engine.transformer.device)}"
    )


@dataclass(frozen=True)
class ModelChoiceFacts:
    """A known model as the TUI's picker shows it (plain values: the TUI imports no
    model code)."""

    name: str
    source: str
    detail: str
    current: bool
    reason: str | None


def model_choices(current: str | None, model_dirs: tuple[str, ...]) -> list[ModelChoiceFacts]:
    """Every model on this machine kvchat can name, with its facts, the running one
    (`current`, as `--model` gave it) marked."""
    from kvchat.model.model_stores import describe
    from kvchat.model.registry import known_models, resolve_model

    try:
        running = resolve_model(current, lambda _line: None, model_dirs=model_dirs).resolve()
    except KvchatError:
        running = None
    out = []
    for m in known_models(model_dirs):
        if not m.available:
            continue
        facts = describe(m.path)
        size = format_size(facts.size) if facts.size else "?"
        detail = ", ".join(
            x for x in (facts.format, size, facts.quantization, facts.architecture) if x
        )
        here = running is not None and m.path.resolve() == running
        out.append(ModelChoiceFacts(m.name, m.kind, detail, here, facts.reason))
    return out


def model_spec_name(spec: str | None) -> str:
    """The model as a session remembers it: what --model took (the default's name for
    none), so it can be looked up again (`model_available`)."""
    from kvchat.model.default_model import DEFAULT_MODEL_NAME

    return spec or DEFAULT_MODEL_NAME


def model_available(spec: str, model_dirs: tuple[str, ...]) -> bool:
    """Whether `--model SPEC` names a model on this machine now (nothing is fetched)."""
    from kvchat.model.default_model import default_gguf_path
    from kvchat.model.registry import DEFAULT_ALIASES, resolve_model

    if spec.lower() in DEFAULT_ALIASES:
        return default_gguf_path().exists()
    try:
        resolve_model(spec, lambda _line: None, model_dirs=model_dirs)
    except KvchatError:
        return False
    return True
