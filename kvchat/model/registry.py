"""Which models kvchat knows locally, and how a `--model` name resolves to a path.

Sources, in the order they are listed and matched: the default model (fetched once from
PyPI), GGUF files converted before (recorded in the conversion cache), then the stores
of other tools and the user's `model_dirs` (`model_stores`). Nothing here touches the
network except the default model's one-time fetch.

A name matches exactly (case aside) or, without its `:QUANT` part, the one model of
that base name; a name that fits several lists them rather than picking one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import ModelLoadError
from kvchat.model.default_model import DEFAULT_MODEL_NAME, default_gguf_path, ensure_default_gguf
from kvchat.model.model_stores import (
    FoundModel,
    scan_folder,
    scan_hf_cache,
    scan_lmstudio,
    scan_ollama,
)
from kvchat.paths import app_paths

DEFAULT_ALIASES = {"default", "smollm2", DEFAULT_MODEL_NAME.lower()}


@dataclass(frozen=True)
class KnownModel:
    name: str
    path: Path
    kind: str  # "default", "gguf" (converted before), "hf-cache", "ollama", "lmstudio", "folder"
    available: bool


def known_models(model_dirs: Iterable[str | Path] = ()) -> list[KnownModel]:
    """Every model kvchat can name, each path once (the first source that names it)."""
    found = [
        KnownModel(DEFAULT_MODEL_NAME, default_gguf_path(), "default", default_gguf_path().exists())
    ]
    seen = {default_gguf_path().resolve()}
    for model in _found(model_dirs):
        key = model.path.resolve()
        if key not in seen:
            seen.add(key)
            found.append(KnownModel(model.name, model.path, model.source, model.path.exists()))
    return found


def _found(model_dirs: Iterable[str | Path]) -> Iterator[FoundModel]:
    yield from _converted_before()
    yield from scan_hf_cache()
    yield from scan_ollama()
    yield from scan_lmstudio()
    for folder in model_dirs:
        yield from scan_folder(Path(folder).expanduser())


def _converted_before() -> Iterator[FoundModel]:
    converted = app_paths().models_dir / "converted"
    if not converted.is_dir():
        return
    for source in sorted(converted.glob("*/source.json")):
        try:
            gguf = Path(json.loads(source.read_text())["gguf"])
        except (OSError, ValueError, KeyError):
            continue
        yield FoundModel(gguf.stem, gguf, "gguf")


def resolve_model(
    spec: str | None,
    progress: Callable[[str], None] = print,
    model_dirs: Iterable[str | Path] = (),
) -> Path:
    """A path to a GGUF file or a model folder for `--model SPEC` (None: the default)."""
    if spec is None or spec.lower() in DEFAULT_ALIASES:
        return ensure_default_gguf(progress)
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{path} is neither a Hugging Face model folder (no config.json) nor a folder "
            "with exactly one .gguf file."
        )
    matches = matching(spec, [m for m in known_models(model_dirs) if m.available])
    if len(matches) == 1:
        return matches[0].path
    if matches:
        names = ", ".join(m.name for m in matches)
        raise ModelLoadError(f"{spec!r} names several models: {names}. Pick one of those names.")
    raise ModelLoadError(
        f"No model found at {spec!r}. Pass a path to a GGUF file or a Hugging Face model "
        "folder, or a name listed by `kvchat models`."
    )


def matching(spec: str, models: list[KnownModel]) -> list[KnownModel]:
    """The models `spec` names: an exact name (or file name), else every model whose
    name is `spec` plus a `:QUANT` or `:TAG` part, else every one whose name without its
    ORG/ part is (`qwen3-1.7b` for `Qwen/Qwen3-1.7B`). Case is ignored."""
    wanted = spec.lower()
    exact = [m for m in models if wanted in (m.name.lower(), m.path.name.lower())]
    if exact:
        return exact
    bases = [(m, m.name.lower().partition(":")[0]) for m in models]
    tagged = [m for m, base in bases if base == wanted]
    if tagged:
        return tagged
    return [m for m, base in bases if "/" not in wanted and base.rpartition("/")[2] == wanted]
