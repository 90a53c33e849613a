"""The user's settings file (TOML under the user config folder), typed.

Keys are named as the command-line options (README.md, "Options and settings") (`device_cache` for
`--device-cache`), so one word means one thing on both. A bad file never
crashes kvchat and is never overwritten: `load_settings_checked` keeps every good
key and gives one sentence per bad one, naming the key and its line (or the TOML
error's line), and the caller shows each once; a bad key keeps its default.
`save_setting` rewrites only the line of the key it changes, so the user's comments
and layout survive.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvchat.errors import KvchatError, UsageError
from kvchat.paths import app_paths
from kvchat.units import parse_size


@dataclass(frozen=True)
class Settings:
    """None means "not set": the model, the hardware or the generation config decides."""

    model: str | None = None  # a path or a model name
    dtype: str | None = None  # "bfloat16" | "float32"
    device_cache: int | None = None  # bytes
    host_cache: int | None = None  # bytes
    disk_cache: int | None = None  # bytes; 0 turns the disk tier off
    page_size: int = 256
    context_size: int | None = None  # tokens; None: the model's context
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int = 512
    theme: str | None = None
    weights: str | None = None  # "native" (GGUF 4-bit kept 4-bit) | "bf16" (dequantized)
    quantize: str | None = None  # "int8" | "int4" for Hugging Face folders
    kv: str | None = None  # "native" | "int8" KV cache
    engine: str | None = None  # "embedded" or an OpenAI-compatible server's URL
    remote_model: str | None = None  # the served model to use on that server
    api_key_env: str | None = None  # the environment variable holding the server's API key
    session_header: str | None = None  # the header carrying the session id (routing)
    attention: str | None = None  # "native" | "flex" | "sdpa"; unset: the device's default
    model_dirs: tuple[str, ...] = ()  # folders of GGUFs / model folders `kvchat models` lists
    keys: MappingProxyType[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # key -> "FILE, line N": where each value was written, for messages about it
    sources: MappingProxyType[str, str] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )


_DTYPES = ("bfloat16", "float32")
_SIZE_KEYS = ("device_cache", "host_cache", "disk_cache")
_ZERO_IS_OFF = (
    "host_cache",
    "disk_cache",
)  # 0 turns these tiers off; the device cache cannot be off
MIN_PAGE_SIZE = 16
_CHOICES = {
    "weights": ("native", "bf16"),
    "quantize": ("int8", "int4"),
    "kv": ("native", "int8"),
    "attention": ("native", "flex", "sdpa"),
}


def _line_of(text: str, key: str, table: str | None = None) -> int | None:
    """The 1-based line where `key =` is written (in `[table]` when given)."""
    current: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.match(r"^\[\s*([^\]]+?)\s*\]", stripped)
        if header:
            current = header.group(1)
            continue
        if current == table and re.match(rf"^[\"']?{re.escape(key)}[\"']?\s*=", stripped):
            return number
    return None


def _where(path: Path, text: str, key: str, table: str | None = None) -> str:
    line = _line_of(text, key, table)
    return f"{path}" + (f", line {line}" if line else "")


def _check(path: Path, text: str, key: str, value: Any) -> Any:
    """The typed value of one top-level key, or a KvchatError naming it."""
    where = _where(path, text, key)

    def bad(expected: str) -> KvchatError:
        return UsageError(f"{where}: '{key}' must be {expected}, not {value!r}")

    if key in ("model", "theme", "engine", "remote_model", "api_key_env", "session_header"):
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if key == "dtype":
        if value not in _DTYPES:
            raise bad(" or ".join(f'"{d}"' for d in _DTYPES))
        return value
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise bad(" or ".join(f'"{c}"' for c in _CHOICES[key]))
        return value
    if key in _SIZE_KEYS:
        off = " or 0 (off)" if key in _ZERO_IS_OFF else " (it cannot be 0)"
        try:
            size = parse_size(value)
        except KvchatError:
            raise bad(f'a size with a unit, like "512MiB" or "4GiB"{off}') from None
        if size == 0 and key not in _ZERO_IS_OFF:
            raise bad(f'a size with a unit, like "512MiB" or "4GiB"{off}')
        return size
    if key == "model_dirs":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise bad('a list of folder paths, like ["~/models"]')
        return tuple(value)
    if key == "page_size":
        if not is_page_size(value):
            raise bad(f"a power of two from {MIN_PAGE_SIZE} up, like 256")
        return value
    if key == "context_size":
        if not is_context_size(value):
            raise bad(f"an integer from {MIN_CONTEXT_SIZE} up, like 4096")
        return value
    if key == "max_tokens":
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise bad("a positive integer")
        return value
    if key == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if key in ("temperature", "top_p"):
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise bad("a number at least 0")
        if key == "top_p" and not 0 < value <= 1:
            raise bad("a number in (0, 1]")
        return float(value)
    raise UsageError(f"{where}: unknown setting '{key}'")


MIN_CONTEXT_SIZE = 256  # room for a system prompt, a question and a reply


def is_context_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= MIN_CONTEXT_SIZE


def is_page_size(value: Any) -> bool:
    """A page holds a power-of-two number of tokens, at least `MIN_PAGE_SIZE`."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= MIN_PAGE_SIZE
        and value & (value - 1) == 0
    )


_KNOWN = tuple(f.name for f in fields(Settings) if f.name != "sources")


def parse_settings_checked(text: str, path: Path) -> tuple[Settings, tuple[str, ...]]:
    """Settings from TOML text, key by key: every good value is kept, and each bad key
    is one problem (a sentence naming the file, line and key) and keeps its default, so
    one typo never costs the user the rest of the file. Invalid TOML keeps nothing."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return Settings(), (f"{path}: not valid TOML: {exc}. Fix the file or move it away.",)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key not in _KNOWN:
            problems.append(
                f"{_where(path, text, key)}: unknown setting '{key}' (known: {', '.join(_KNOWN)})."
            )
            continue
        if key == "keys":
            if not isinstance(value, dict):
                problems.append(f"{_where(path, text, key)}: 'keys' must be a table [keys].")
                continue
            good = {}
            for binding, keyname in value.items():
                if not isinstance(keyname, str) or not keyname:
                    problems.append(
                        f"{_where(path, text, binding, 'keys')}: key binding '{binding}' "
                        f'must be a key name string, like "ctrl+n".'
                    )
                    continue
                good[binding] = keyname
            values["keys"] = MappingProxyType(good)
            continue
        try:
            values[key] = _check(path, text, key, value)
        except KvchatError as exc:
            problems.append(f"{exc}.")
    sources = {key: _where(path, text, key) for key in values}
    for binding in values.get("keys", {}):  # for messages about a key binding's value
        sources[f"keys.{binding}"] = _where(path, text, binding, "keys")
    return Settings(**values, sources=MappingProxyType(sources)), tuple(problems)


def parse_settings(text: str, path: Path) -> Settings:
    """Settings from TOML text; KvchatError names the first bad key or the TOML line
    (for edits, which never write into a file with a problem)."""
    settings, problems = parse_settings_checked(text, path)
    if problems:
        raise UsageError(problems[0].removesuffix("."))
    return settings


def load_settings_checked(path: Path | None = None) -> tuple[Settings, tuple[str, ...]]:
    """The settings file's good values (defaults when it does not exist) and a problem
    sentence for each bad key (`parse_settings_checked`)."""
    path = path or app_paths().settings_file
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Settings(), ()
    except (OSError, UnicodeDecodeError) as exc:
        return Settings(), (f"cannot read the settings file {path}: {exc}.",)
    return parse_settings_checked(text, path)


def load_settings(path: Path | None = None) -> Settings:
    """The settings file's values (defaults when it does not exist); KvchatError when bad."""
    settings, problems = load_settings_checked(path)
    if problems:
        raise KvchatError(problems[0].removesuffix("."))
    return settings


def _toml_value(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def save_setting(key: str, value: str | int | float | bool, path: Path | None = None) -> None:
    """Set one top-level key, keeping every other line (comments included) as it was.

    Raises KvchatError for an unknown key or a bad value, and when the file is
    not valid TOML (the user's file is never overwritten with a guess).
    """
    path = path or app_paths().settings_file
    line = f"{key} = {_toml_value(value)}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    parse_settings(text, path)  # refuse to edit a broken file
    _check(path, line, key, value)
    lines = text.splitlines()
    number = _line_of(text, key)
    if number is not None:
        lines[number - 1] = line
    else:  # before the first table, so it stays a top-level key
        first_table = next((i for i, x in enumerate(lines) if re.match(r"^\s*\[", x)), len(lines))
        lines.insert(first_table, line)
    new_text = "\n".join(lines) + "\n"
    parse_settings(new_text, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new_text, encoding="utf-8")
    os.replace(tmp, path)
