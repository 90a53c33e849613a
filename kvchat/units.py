"""Byte sizes as users write them ("512MiB", "4GiB", "1.5G", "1000000").

The command line and the settings file take cache sizes in these units; one
parser keeps both readings identical.
"""

from __future__ import annotations

import re

from kvchat.errors import KvchatError

_UNITS: dict[str, int] = {
    "": 1,
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


def parse_size(text: str | int) -> int:
    """Bytes from "512MiB", "4GiB", "1.5G" (binary), "2GB" (decimal) or a plain integer."""
    if isinstance(text, bool):
        raise KvchatError(f"{text!r} is not a size; write bytes with a unit, like 512MiB or 4GiB")
    if isinstance(text, int):
        if text < 0:
            raise KvchatError(f"size {text} is negative; write bytes with a unit, like 512MiB")
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise KvchatError(f"{text!r} is not a size; write bytes with a unit, like 512MiB or 4GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """The shortest binary-unit spelling that parse_size reads back (approximately)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"
