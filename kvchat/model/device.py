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
        return torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device must be cpu or cuda (or cuda:N), not {name!r}.") from None


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
