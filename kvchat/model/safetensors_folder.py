"""Read a Hugging Face model folder's weights: one or many (sharded) *.safetensors files.

Tensors are memory-mapped by safetensors and cast to the compute dtype one by one,
so peak memory is the converted model plus one tensor. gpt-oss's checkpoints hold their
experts in MXFP4 (`NAME_blocks`, `NAME_scales`): read as the one tensor NAME,
dequantized as transformers dequantizes them (`dequantize_mxfp4`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvchat.errors import ModelLoadError


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({exc}).") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(
                f"{folder} is missing weight shards listed in its index: {', '.join(missing)}. "
                "Finish the download, or pick another model with --model."
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{folder} has no *.safetensors weights. kvchat reads Hugging Face folders with "
            "safetensors weights, or GGUF files."
        )
    return files


def text_model_name(name: str) -> str | None:
    """A weight's name in the text model kvchat runs: a vision-language checkpoint's
    language model (Gemma 3 4B and up: `language_model.model.*`, or transformers 5's
    `model.language_model.*`) under the names of a text-only one; its vision tower and
    projector, and Qwen3.5's multi-token-prediction head (`mtp.*`, which transformers
    does not run either), None (never read). Other names as they are."""
    for prefix, to in (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ):
        if name.startswith(prefix):
            return to + name[len(prefix) :]
    if name.startswith(VISION_PREFIXES):
        return None
    return name


VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.visual.",  # Qwen3.5's
    "mtp.",  # Qwen3.5's draft head: not a vision weight, but as little read
)


def read_tensors(
    folder: Path, dtype: torch.dtype, device: torch.device, files: list[Path] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's text model (or of `files` only), in `dtype` on
    `device`, named as a text-only model names it (`text_model_name`)."""
    packed: dict[str, torch.Tensor] = {}  # MXFP4 halves read, waiting for the other
    for path in files if files is not None else weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    text_name = text_model_name(name)
                    if text_name is None:
                        continue
                    if text_name.endswith(MXFP4_PARTS):
                        base, _, part = text_name.rpartition("_")
                        packed[f"{base}_{part}"] = f.get_tensor(name)
                        blocks, scales = packed.get(f"{base}_blocks"), packed.get(f"{base}_scales")
                        if blocks is not None and scales is not None:
                            del packed[f"{base}_blocks"], packed[f"{base}_scales"]
                            weight = dequantize_mxfp4(blocks, scales)
                            yield base, weight.to(device=device, dtype=dtype)
                        continue
                    yield text_name, f.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"{path} is corrupt or truncated ({exc}). Re-download the model."
            ) from exc
    if packed:
        raise ModelLoadError(
            f"{folder} holds half of an MXFP4 tensor ({', '.join(packed)}) without its other "
            "half. Finish the download, or re-download the model."
        )


MXFP4_PARTS = ("_blocks", "_scales")
# E2M1's sixteen values, as OpenAI's checkpoints code them
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's MXFP4 experts in float32, laid out as transformers' GptOssExperts holds
    them: blocks [E, rows, G, 16] (two 4-bit codes a byte, low nibble first), scales
    [E, rows, G] (a power of two, biased by 127) -> [E, G * 32, rows]."""
    if blocks.shape[:-1] != scales.shape or blocks.dtype != torch.uint8:
        raise ModelLoadError(
            f"an MXFP4 tensor's blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
            "do not fit together; the checkpoint is damaged. Re-download the model."
        )
    *prefix, groups, width = blocks.shape
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    out = values[codes].reshape(*prefix, groups, width * 2)
    out = torch.ldexp(out, scales.to(torch.int32).unsqueeze(-1) - 127)
    return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()
