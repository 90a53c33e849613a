"""Which device and activation dtype to compute in.

CUDA when present, else CPU. bf16 where the hardware computes it natively (CUDA
with bf16 support; a CPU whose oneDNN reports bf16, e.g. AVX-512 BF16 or AMX),
else float32: emulated bf16 is slower than float32 and less exact.
"""

from __future__ import annotations

import torch

from kvchat.errors import KvchatError, UsageError

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def parse_device(name: str | None) -> torch.device:
    """The device `--device NAME` names (None: the default)."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda (or cuda:N), not {name!r}.")
    if device.type == "cuda":  # refused here, before a model is converted for it
        if not torch.cuda.is_available():
            built = (
                "this torch is a CPU-only build"
                if torch.version.cuda is None
                else ("torch sees no NVIDIA GPU")
            )
            raise UsageError(
                f"--device {name}: {built}. Leave --device out to run on the CPU, or install "
                "a CUDA build of torch on a machine with an NVIDIA GPU."
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(
                f"--device {name}: there is no GPU {device.index}; this machine has {count} "
                f"(cuda:0 to cuda:{count - 1})."
            )
    return device


def bf16_is_native(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The dtype for `--dtype NAME` (None: bf16 where native, else float32)."""
    if name is None or name == "auto":
        return torch.bfloat16 if bf16_is_native(device) else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise KvchatError(
            f"Unknown dtype {name!r}: use one of {', '.join(DTYPES)} (or leave it unset)."
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
