"""`kvchat pull ORG/NAME[:QUANT]`: a model from the Hugging Face hub, into its cache.

Through `huggingface_hub`, so the download is what users of that library get: the
hub cache (where `kvchat models` finds it next), a lost connection resumed from where
it stopped, a progress bar, `HF_TOKEN` for gated models and `HF_ENDPOINT` for mirrors.
(The library keeps no partial file between runs: a download that fails for good leaves
the cache clean, and the command run again starts the file over.) What the model is gets
checked before the weights come: a model folder's config.json is fetched first and
put through the loader's checks, a GGUF repository's architecture is read from the
hub's own parse of the file, so an unsupported model costs a few kilobytes, not
gigabytes. A GGUF repository gives one file: the quantization asked for, else
Q4_K_M where there is one (the size people run on a CPU), else the list to pick from.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError, ModelLoadError
from kvchat.model.model_stores import quant_in_name

PREFERRED_QUANT = "Q4_K_M"
# what a model folder needs; the rest of a repository (other formats, originals) stays
FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class PullError(KvchatError):
    """A pull that cannot be done, said in one line with what to do."""


@dataclass(frozen=True)
class Pulled:
    path: Path  # the GGUF file or the model folder, in the hub cache
    name: str  # what `--model` takes for it


def pull(spec: str, progress: Callable[[str], None] = print) -> Pulled:
    repo_id, _, quant = spec.partition(":")
    if not _REPO_ID.match(repo_id):
        raise PullError(
            f"{spec!r} is not a hub model name: use ORG/NAME or ORG/NAME:QUANT, like "
            "Qwen/Qwen3-0.6B or unsloth/Qwen3-1.7B-GGUF:Q4_K_M."
        )
    try:
        return _pull(repo_id, quant.upper() or None, progress)
    except KvchatError:
        raise
    except Exception as exc:  # the library's and the network's errors, each in one line
        raise PullError(_explain(exc, repo_id)) from exc


def _pull(repo_id: str, quant: str | None, progress: Callable[[str], None]) -> Pulled:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    info = HfApi().model_info(repo_id, expand=["siblings", "gguf", "sha"])
    files = [s.rfilename for s in info.siblings or []]
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        if quant:
            raise PullError(
                f"{repo_id} is a model folder, not GGUF files: pull it without ':{quant}'."
            )
        config = hf_hub_download(repo_id, "config.json", revision=info.sha)
        _check_folder_config(Path(config), repo_id)
        progress(f"Fetching {repo_id} into the Hugging Face cache...")
        folder = snapshot_download(repo_id, revision=info.sha, allow_patterns=FOLDER_FILES)
        return Pulled(Path(folder), repo_id)
    ggufs = [f for f in files if f.endswith(".gguf") and "mmproj" not in f.lower()]
    if not ggufs:
        raise PullError(
            f"{repo_id} holds neither a model folder (config.json and safetensors) nor "
            "GGUF files: kvchat cannot run it."
        )
    filename = _choose(repo_id, ggufs, quant)
    _check_gguf_architecture(info.gguf, repo_id)
    progress(f"Fetching {filename} from {repo_id} into the Hugging Face cache...")
    path = Path(hf_hub_download(repo_id, filename, revision=info.sha))
    name = (
        repo_id
        if len(ggufs) == 1
        else f"{repo_id}:{quant_in_name(filename) or Path(filename).stem}"
    )
    return Pulled(path, name)


def _choose(repo_id: str, ggufs: list[str], quant: str | None) -> str:
    """The GGUF file of `quant` (one file: that one; none asked: Q4_K_M where there is)."""
    by_quant = {(quant_in_name(f) or "").upper(): f for f in ggufs}
    if quant is None and len(ggufs) == 1:
        return ggufs[0]
    wanted = quant or PREFERRED_QUANT
    split = [f for f in ggufs if re.search(r"-\d{5}-of-\d{5}\.gguf$", f)]
    if wanted in by_quant and by_quant[wanted] not in split:
        return by_quant[wanted]
    offered = ", ".join(sorted(q for q in by_quant if q)) or ", ".join(ggufs)
    if wanted in by_quant:
        raise PullError(f"{repo_id}'s {wanted} file is split in parts, which kvchat does not read.")
    asked = f"has no {wanted} file" if quant else "holds several GGUF files"
    raise PullError(f"{repo_id} {asked}; pick one: {offered} (as {repo_id}:QUANT).")


def _check_folder_config(config: Path, repo_id: str) -> None:
    import json

    from kvchat.model.config import ModelConfig

    try:
        ModelConfig.from_dict(json.loads(config.read_text(encoding="utf-8")))
    except (ValueError, OSError) as exc:
        raise PullError(f"{repo_id}'s config.json cannot be read ({exc}).") from exc
    except ModelLoadError as exc:
        raise PullError(f"{repo_id} is not a model kvchat runs: {exc}") from exc


def _check_gguf_architecture(gguf: dict | None, repo_id: str) -> None:
    """The hub parses every GGUF's header; its architecture field says enough to refuse
    before the download. (A mirror that does not say is checked after.)"""
    from kvchat.model.gguf.convert import SUPPORTED_ARCHITECTURES

    arch = (gguf or {}).get("architecture")
    if arch is not None and arch not in SUPPORTED_ARCHITECTURES:
        raise PullError(
            f"{repo_id} is a {arch} model, which kvchat does not run (it runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUFs)."
        )


def _explain(exc: Exception, repo_id: str) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, GatedRepoError):
        return (
            f"{repo_id} is gated: accept its terms on the hub and set HF_TOKEN to a token "
            "of that account."
        )
    if isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
        return f"there is no model {repo_id} on the hub (or it is private: set HF_TOKEN)."
    if isinstance(exc, LocalEntryNotFoundError):
        return (
            f"the hub cannot be reached ({_first_line(exc)}); check the network (or "
            "HF_ENDPOINT) and run the same command again."
        )
    return (
        f"fetching {repo_id} failed: {_first_line(exc)}. Nothing half-fetched is kept; "
        "run the same command again when the hub is reachable."
    )


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
