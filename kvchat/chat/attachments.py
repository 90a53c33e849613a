"""A file attached to a message: its text in a fenced block, or a clear error."""

from __future__ import annotations

from pathlib import Path

from kvchat.errors import KvchatError

MAX_ATTACH_BYTES = 2_000_000


def attachment_text(path: Path) -> str:
    """A file's text as a fenced block for the message; KvchatError when it is not text."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise KvchatError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise KvchatError(f"{path} is not a file")
    if size > MAX_ATTACH_BYTES:
        raise KvchatError(f"{path} is {size:,} bytes; attach files under {MAX_ATTACH_BYTES:,}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvchatError(f"{path} is not a UTF-8 text file") from None
    except OSError as exc:
        raise KvchatError(f"cannot read {path}: {exc.strerror or exc}") from None
    fence = "```"
    while fence in text:
        fence += "`"
    return f"File `{path.name}`:\n\n{fence}\n{text.rstrip()}\n{fence}\n"
