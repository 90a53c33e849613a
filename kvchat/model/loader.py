"""One entry point for every model source: `load_model(spec)`.

A GGUF file is converted once into a Hugging Face style folder in the cache
(config.json, tokenizer files, weights as safetensors in the compute dtype),
keyed by the file's content hash, so later starts memory-map it instead of
dequantizing again. After that, every source is a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from kvchat.errors import ModelLoadError
from kvchat.malloc_trim import glibc_malloc_trim
from kvchat.model.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from kvchat.model.config import ModelConfig
from kvchat.model.device import default_device, dtype_name, resolve_dtype
from kvchat.model.safetensors_folder import read_tensors, weight_files
from kvchat.model.tokenizer import Tokenizer
from kvchat.model.transformer import Transformer, split_fused_weights
from kvchat.model.turn_renderer import TurnRenderer
from kvchat.paths import app_paths

Progress = Callable[[str], None]
CONVERSION_VERSION = 1  # bump when the converted folder's layout changes
# bump when the prepared layers change (9: K-quants' own scales in bf16; 10: the Gated
# DeltaNet's projections)
NATIVE_CACHE_VERSION = 10


@dataclass
class LoadedModel:
    """Everything the engine and the chat layer need from a model, loaded once."""

    name: str
    source: Path
    folder: Path  # the Hugging Face style folder actually read
    config: ModelConfig
    transformer: Transformer
    tokenizer: Tokenizer
    renderer: TurnRenderer
    fingerprint: str  # identity of the weights: salts page hashes, tags session ids
    generation_defaults: dict[str, float]

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings


WEIGHT_MODES = ("native", "bf16", "dense")


def load_model(
    spec: str | None = None,
    *,
    dtype: str | None = None,
    device: str | None = None,
    weights: str = "native",
    quantize: str | None = None,
    progress: Progress = lambda _msg: None,
    name: str | None = None,
) -> LoadedModel:
    """Load a model from any source.

    `weights="native"` keeps a GGUF's 4-bit matrices 4-bit on the CPU (the fast decode
    path); "bf16"/"dense" dequantizes everything to the compute dtype. `quantize`
    ("int8"/"int4") quantizes a Hugging Face folder's matrices at load. `name` is what
    the model is called where it is shown (the name it was asked by, where the file's
    own is a store's blob name); the file's or folder's name otherwise.
    """
    from kvchat.model.registry import resolve_model  # registry imports the default-model fetcher

    if weights not in WEIGHT_MODES:
        raise ModelLoadError(f"Unknown --weights {weights!r}: use native or bf16.")
    if quantize not in (None, "int8", "int4"):
        raise ModelLoadError(f"Unknown --quantize {quantize!r}: use int8 or int4.")
    source = resolve_model(spec, progress=progress)
    dev = torch.device(device) if device else default_device()
    torch_dtype = resolve_dtype(dtype, dev)
    if source.is_file():
        folder = convert_gguf(source, torch_dtype, progress, label=name)
        fingerprint = folder.name
    else:
        folder = source
        fingerprint = folder_fingerprint(folder)
    config = ModelConfig.from_file(folder / "config.json")
    tokenizer = Tokenizer.from_folder(folder)
    progress(f"Loading {name or source.name} ({dtype_name(torch_dtype)} on {dev.type})...")
    # a converted folder holds one weights file per dtype and the prepared 4-bit caches:
    # read only this dtype's weights
    files = [folder / f"model-{dtype_name(torch_dtype)}.safetensors"] if source.is_file() else None
    tensors = split_fused_weights(config, dict(read_tensors(folder, torch_dtype, dev, files=files)))
    note = dense_weights_note(dev, source.is_file(), weights, quantize)
    if note:
        progress(note)
    if source.is_file() and weights == "native" and dev.type == "cpu":
        quantized = _native_quantized(source, folder, config, torch_dtype, tensors, progress)
        if quantized:
            tensors.update(quantized)
            fingerprint += "-q4native"
    elif quantize is not None:
        tensors.update(_quantized_folder(fingerprint, quantize, config, torch_dtype, dev, tensors))
        fingerprint += f"-{quantize}"
    transformer = Transformer(config, tensors)
    if dev.type == "cpu" and (trim := glibc_malloc_trim()) is not None:
        trim()  # what loading freed (the prepared layers' copies before the arena): ~200 MB
    template = ChatTemplate(
        tokenizer.chat_template or DEFAULT_CHATML_TEMPLATE,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    return LoadedModel(
        name=name or (source.stem if source.is_file() else source.name),
        source=source,
        folder=folder,
        config=config,
        transformer=transformer,
        tokenizer=tokenizer,
        renderer=TurnRenderer(tokenizer, template),
        fingerprint=fingerprint,
        generation_defaults=_generation_defaults(folder),
    )


def dense_weights_note(
    device: torch.device, gguf: bool, weights: str, quantize: str | None
) -> str | None:
    """What a start off the CPU says about weights the CPU would keep quantized: kvchat's
    4-bit and 8-bit kernels are CPU kernels, so elsewhere the weights are dense (bf16 where
    the device computes it). None when nothing is dequantized."""
    if device.type == "cpu":
        return None
    where = device.type.upper()
    if gguf and weights == "native":
        return f"4-bit weights dequantized on {where} (kvchat's 4-bit kernels are CPU-only)."
    if quantize is not None:
        return f"--quantize {quantize} is not applied on {where}: its weights stay dense."
    return None


def _native_quantized(source, folder, config, dtype, tensors, progress) -> dict:
    """The GGUF's 4-bit layers, prepared once and cached beside the converted weights."""
    from kvchat.model.gguf.file import GGUFFile
    from kvchat.model.gguf.weights import quantized_linears
    from kvchat.model.quantized_linear import load_linears, save_linears

    cache = folder / f"native-q4-v{NATIVE_CACHE_VERSION}-{dtype_name(dtype)}.safetensors"
    if cache.exists():
        try:
            return load_linears(cache)
        except Exception:  # a damaged cache is rebuilt, never fatal
            cache.unlink(missing_ok=True)
    # an older kvchat's prepared layers are never read again: a GB or more each
    for stale in folder.glob(f"native-q4-v*-{dtype_name(dtype)}.*"):
        stale.unlink(missing_ok=True)
    progress("Preparing the 4-bit weights for the CPU kernels, once...")
    quantized = quantized_linears(GGUFFile.open(source), config, dtype, tensors)
    # no room to cache: it is rebuilt at the next start
    with contextlib.suppress(OSError, SafetensorError):
        save_linears(cache, quantized)
    return quantized


def _quantized_folder(fingerprint, mode, config, dtype, device, tensors) -> dict:
    """`--quantize` layers for a Hugging Face folder, cached on disk after the first start."""
    from kvchat.model.quantize import quantize_weights
    from kvchat.model.quantized_linear import load_linears, save_linears

    if device.type != "cpu":
        return {}
    cache = (
        app_paths().models_dir
        / "quantized"
        / f"{fingerprint}-{mode}-{dtype_name(dtype)}.safetensors"
    )
    if cache.exists():
        try:
            return load_linears(cache)
        except Exception:  # a damaged cache is rebuilt, never fatal
            cache.unlink(missing_ok=True)
    quantized = quantize_weights(tensors, config, mode, dtype, device)
    # no room to cache: it is rebuilt at the next start
    with contextlib.suppress(OSError, SafetensorError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_linears(cache, quantized)
    return quantized


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """Cheap identity of a safetensors folder: config, and each file's size and header."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in weight_files(folder):
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(path.name.encode())
            digest.update(str(path.stat().st_size).encode())
            digest.update(f.read(min(header_len, 1 << 24)))
            f.seek(-min(1 << 16, path.stat().st_size), 2)
            digest.update(f.read())
    return "hf-" + digest.hexdigest()[:24]


def convert_gguf(
    path: Path, dtype: torch.dtype, progress: Progress, label: str | None = None
) -> Path:
    """The cached Hugging Face style folder for a GGUF file, converting it on first use."""
    from kvchat.model.gguf.convert import gguf_state_dict, gguf_to_hf_config
    from kvchat.model.gguf.file import GGUFFile
    from kvchat.model.gguf.tokenizer import tokenizer_parts_from_gguf

    if not path.exists():
        raise ModelLoadError(f"{path} does not exist.")
    key = f"gguf-{file_sha256(path)[:24]}-v{CONVERSION_VERSION}"
    folder = app_paths().models_dir / "converted" / key
    weights_file = folder / f"model-{dtype_name(dtype)}.safetensors"
    if weights_file.exists() and (folder / "config.json").exists():
        return folder
    progress(f"Converting {label or path.name} for kvchat ({dtype_name(dtype)}), once...")
    gguf = GGUFFile.open(path)
    config = gguf_to_hf_config(gguf)
    ModelConfig.from_dict(config)  # refuse unsupported architectures before the heavy work
    parts = tokenizer_parts_from_gguf(gguf.metadata)
    tensors = {name: t.contiguous() for name, t in gguf_state_dict(gguf, dtype)}
    folder.mkdir(parents=True, exist_ok=True)
    try:
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        parts.backend.save(str(folder / "tokenizer.json"))
        tok_config = {
            "bos_token": parts.bos_token,
            "eos_token": parts.eos_token,
            "add_bos_token": parts.add_bos_token,
            "chat_template": parts.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        (folder / "source.json").write_text(json.dumps({"gguf": str(path.resolve())}))
        partial = weights_file.with_suffix(".partial")
        save_file(tensors, str(partial))
        partial.replace(weights_file)  # atomic: an interrupted conversion is redone, not half-read
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own
        weights_file.with_suffix(".partial").unlink(missing_ok=True)
        raise ModelLoadError(
            f"Could not write the converted model to {folder} ({exc}). Is the disk full? "
            f"It needs about {_bytes_of(tensors) / 2**30:.1f} GiB free there."
        ) from exc
    progress(f"Converted model cached in {folder}")
    return folder


def _bytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _generation_defaults(folder: Path) -> dict[str, float]:
    """Chat sampling defaults: the model's generation_config, else temperature 0.7, top-p 0.9."""
    defaults: dict[str, float] = {"temperature": 0.7, "top_p": 0.9}
    path = folder / "generation_config.json"
    if path.exists():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return defaults
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if isinstance(raw.get(key), int | float):
                defaults[key] = float(raw[key])
        if raw.get("do_sample") is False:
            defaults["temperature"] = 0.0
    return defaults
