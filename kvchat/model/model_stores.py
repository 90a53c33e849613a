"""The models other tools already keep on this machine, found where they keep them.

Users of local models have them before they meet kvchat: in Hugging Face's hub cache
(read with `huggingface_hub.scan_cache_dir`, the library's own reader of its layout),
in Ollama's store (a manifest per tag naming a GGUF blob), in LM Studio's folder
(PUBLISHER/MODEL/*.gguf), or in folders of their own (the `model_dirs` setting). Each
is read in place: nothing is copied, and nothing is written into another tool's
folders (a GGUF's conversion goes to kvchat's own cache, keyed by the file's hash).

Every model found is described by what its files say (`describe`): format, size,
quantization, architecture, and whether kvchat runs it, with the reason when not,
from the same checks loading applies.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
# a quantization named in a GGUF file's name: Q4_K_M, IQ4_XS, Q8_0, BF16, F16, ...
_QUANT_IN_NAME = re.compile(r"(?:^|[-._])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=[-._]|$)", re.I)


@dataclass(frozen=True)
class FoundModel:
    """A model in another tool's store (or a folder of the user's), before inspection."""

    name: str  # what `--model` takes: ORG/NAME, ORG/NAME:QUANT, an Ollama tag, a file stem
    path: Path  # a GGUF file or a Hugging Face model folder
    source: str  # "hf-cache", "ollama", "lmstudio", "folder"


@dataclass(frozen=True)
class ModelFacts:
    """What a model's files say of it; `reason` says why kvchat cannot run it (or None)."""

    format: str  # "gguf" or "hf"
    size: int  # bytes of weights
    quantization: str | None
    architecture: str | None
    reason: str | None

    @property
    def supported(self) -> bool:
        return self.reason is None


def hf_cache_dir() -> Path:
    """Hugging Face's hub cache, as huggingface_hub resolves it (HF_HUB_CACHE, HF_HOME)."""
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def ollama_models_dir() -> Path:
    """Ollama's store: OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS", Path.home() / ".ollama" / "models"))


def lmstudio_models_dirs() -> list[Path]:
    """LM Studio's model folders, the current one first (its older releases used the second)."""
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def quant_in_name(filename: str) -> str | None:
    """The quantization a GGUF's file name states (`...-Q4_K_M.gguf` -> "Q4_K_M")."""
    found = _QUANT_IN_NAME.findall(Path(filename).stem)
    return found[-1].upper() if found else None


def _ggufs(folder: Path) -> list[Path]:
    """The model files of a folder: GGUFs, less vision projectors (mmproj-*)."""
    return sorted(
        p for p in folder.glob("*.gguf") if p.is_file() and not p.name.lower().startswith("mmproj")
    )


def _named_ggufs(base: str, files: list[Path], source: str) -> Iterator[FoundModel]:
    """One entry for a lone GGUF (`base`), or one a file with its quantization
    (`base:Q4_K_M`) where a repository or folder holds several."""
    if len(files) == 1:
        yield FoundModel(base, files[0], source)
        return
    for f in files:
        yield FoundModel(f"{base}:{quant_in_name(f.name) or f.stem}", f, source)


def scan_hf_cache(hub: Path | None = None) -> Iterator[FoundModel]:
    """Model repositories in the hub cache: a snapshot with config.json is a model folder;
    one with GGUF files gives one entry a file. The newest revision of each repository."""
    hub = hub or hf_cache_dir()
    if not hub.is_dir():
        return
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub)
    except (CacheNotFound, OSError, ValueError):
        return
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        snapshot = Path(newest.snapshot_path)
        if (snapshot / "config.json").is_file():
            yield FoundModel(repo.repo_id, snapshot, "hf-cache")
        else:
            yield from _named_ggufs(repo.repo_id, _ggufs(snapshot), "hf-cache")


def scan_ollama(root: Path | None = None) -> Iterator[FoundModel]:
    """Ollama's tags: manifests/HOST/NAMESPACE/MODEL/TAG (JSON) name the model's GGUF blob
    (blobs/sha256-HEX). Library models are named as Ollama names them (`llama3.2:1b`)."""
    root = root or ollama_models_dir()
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for manifest in sorted(p for p in manifests.glob("*/*/*/*") if p.is_file()):
        tag, model, namespace, host = manifest.parts[-1:-5:-1]
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            digest = next(x["digest"] for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
            continue  # not a model's manifest (an adapter, a damaged file)
        blob = root / "blobs" / str(digest).replace(":", "-")
        if not blob.is_file():
            continue
        if host == OLLAMA_REGISTRY:
            name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        else:
            name = f"{host}/{namespace}/{model}:{tag}"
        yield FoundModel(name, blob, "ollama")


def scan_lmstudio(roots: list[Path] | None = None) -> Iterator[FoundModel]:
    """LM Studio's PUBLISHER/MODEL folders of GGUF files."""
    for root in roots or lmstudio_models_dirs():
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            base = f"{folder.parent.name}/{folder.name}"
            yield from _named_ggufs(base, _ggufs(folder), "lmstudio")


def scan_folder(folder: Path) -> Iterator[FoundModel]:
    """A folder of the user's (`model_dirs`): its GGUF files and Hugging Face model
    folders, at its top level and one level down."""
    if not folder.is_dir():
        return
    for candidate in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]:
        if (candidate / "config.json").is_file() and candidate != folder:
            yield FoundModel(candidate.name, candidate, "folder")
            continue
        for f in _ggufs(candidate):
            yield FoundModel(f.stem, f, "folder")


def describe(path: Path) -> ModelFacts:
    """What a GGUF file or a Hugging Face folder says of itself, and whether kvchat runs
    it (the reason loading would give when not). Reads the header and config only."""
    if path.is_file():
        return _describe_gguf(path)
    return _describe_folder(path)


def _describe_gguf(path: Path) -> ModelFacts:
    from kvchat.model.config import ModelConfig
    from kvchat.model.gguf.convert import gguf_to_hf_config
    from kvchat.model.gguf.file import GGUFFile

    size = path.stat().st_size
    try:
        gguf = GGUFFile.open(path)
    except KvchatError as exc:
        return ModelFacts("gguf", size, None, None, str(exc))
    arch = gguf.metadata.get("general.architecture")
    # the type most of the matrices have: what "a Q4_K_M file" means in practice
    types = Counter(
        info.ggml_type for info in gguf.tensors.values() if len(info.shape) >= 2
    ).most_common(1)
    quant = _ggml_type_name(types[0][0]) if types else None
    try:
        ModelConfig.from_dict(gguf_to_hf_config(gguf))
        reason = None
    except KvchatError as exc:
        reason = str(exc)
    return ModelFacts("gguf", size, quant, str(arch) if arch else None, reason)


def _describe_folder(path: Path) -> ModelFacts:
    from kvchat.model.config import ModelConfig

    size = sum(f.stat().st_size for f in path.glob("*.safetensors") if f.exists())
    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return ModelFacts("hf", size, None, None, f"config.json cannot be read ({exc})")
    quant_config = raw.get("quantization_config") or {}
    quant = quant_config.get("quant_method") or raw.get("torch_dtype") or raw.get("dtype")
    try:
        ModelConfig.from_dict(raw)
        reason = None if size else "no .safetensors weights in the folder"
    except KvchatError as exc:
        reason = str(exc)
    if reason is None and quant_config:
        reason = f"its weights are pre-quantized ({quant}), which kvchat does not read"
    return ModelFacts("hf", size, str(quant) if quant else None, raw.get("model_type"), reason)


def _ggml_type_name(ggml_type: int) -> str:
    from kvchat.model.gguf.file import GGMLType

    try:
        return GGMLType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"
