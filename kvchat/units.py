"""Byte sizes as users write them ("512MiB", "4GiB", "1.5G", "2GB"; "0" alone needs no unit).

The command line and the settings file take cache sizes in these units; one
parser keeps both readings identical. Why a unit is required: `device_cache = 512`
was read as 512 bytes when its writer meant MiB; a bare number other than 0 is
refused instead of guessed.
"""

from __future__ import annotations

import re

from kvchat.errors import UsageError

_UNITS: dict[str, int] = {
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


_HINT = "write bytes with a unit, like 512MiB or 4GiB"


def parse_size(text: str | int) -> int:
    """Bytes from "512MiB", "4GiB", "1.5G" (binary), "2GB" (decimal), "100B", or 0.

    Raises UsageError (the caller adds which flag or settings line it came from).
    """
    if isinstance(text, bool) or not isinstance(text, str | int):
        raise UsageError(f"{text!r} is not a size; {_HINT}")
    if isinstance(text, int):
        if text == 0:
            return 0
        raise UsageError(f"{text} has no unit; {_HINT} (a bare number is not guessed)")
    match = _SIZE_RE.match(text)
    if match is None:
        raise UsageError(f"{text!r} is not a size; {_HINT}")
    unit = match.group(2).lower()
    value = float(match.group(1))
    if not unit:
        if value == 0:
            return 0
        raise UsageError(f"{text!r} has no unit; {_HINT} (a bare number is not guessed)")
    if unit not in _UNITS:
        raise UsageError(f"{text!r} is not a size; {_HINT}")
    return int(value * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """The shortest binary-unit spelling that parse_size reads back (approximately)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
